"""Which pushes weight-sync's version store takes: never an older version than the latest complete
one, and the latest one again only when a restart lost its bytes (its number survives in KV)."""

from __future__ import annotations

import pytest

from bench.harness.synthetic_weights import random_state, rank_requests
from services.kit.rpc.errors import FailedPrecondition
from services.modeling.config import ModelConfig
from services.weight_sync.versions import VersionStore

STATE = random_state(ModelConfig.tiny())


def push(store: VersionStore, version: int) -> None:
    buf = None
    for req in rank_requests(STATE, version=version, rank=0, world=1):
        buf = store.buffer_for(req)
        for i, chunk in enumerate(req.shards):
            buf.add_chunk(0, chunk, i)
        if req.last:
            buf.ranks_done.add(0)
    assert buf is not None and buf.complete
    store.completed(buf)


def test_after_a_restart_the_lost_latest_version_can_be_pushed_again_but_nothing_older():
    store = VersionStore(latest_version=16, shm=False)  # restored from KV, bytes gone
    with pytest.raises(FailedPrecondition, match="not newer"):
        push(store, 15)
    push(store, 16)
    assert store.latest is not None and store.latest.version == 16


def test_a_version_held_complete_is_not_taken_again():
    store = VersionStore(shm=False)
    push(store, 3)
    with pytest.raises(FailedPrecondition, match="not newer"):
        push(store, 3)
    push(store, 4)
    assert store.latest_version == 4
