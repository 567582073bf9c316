"""Which trainer instance trained which steps of a run: the origin check on TrainStepRecords.

Each time the trainer starts a run's ranks (a process start, a resume, a recovery after a lost
rank) it opens an epoch before training: a random id and the step it resumes at, appended to the
run's entry in the KV bucket `trainer-epochs`, which only the trainer may write (kit/bus/nats_auth.py).
Every step record carries its epoch. Epoch i vouches for the steps [from_i, from_{i+1}): a record
of the newest epoch, or of an older one for a step no later epoch trains again, is genuine. The
gateway ignores (and counts) the rest: a record of an unknown epoch is forged, and one that a later
epoch retrains comes from a stale instance (a crashed trainer's record still in flight).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict, dataclass

from services.kit.bus.kv import KV, KVConflict


@dataclass(frozen=True)
class Epoch:
    id: str
    from_step: int


def parse(raw: bytes | None) -> list[Epoch]:
    return [Epoch(str(e["id"]), int(e["from_step"])) for e in json.loads(raw)] if raw else []


def vouches(epochs: list[Epoch], epoch_id: str, step: int) -> bool:
    """Whether a record of `step` from `epoch_id` is genuine under `epochs` (oldest first)."""
    for i, epoch in enumerate(epochs):
        if epoch.id == epoch_id:
            return i == len(epochs) - 1 or step < epochs[i + 1].from_step
    return False


async def open_epoch(kv: KV, run_id: str, from_step: int, keep: int = 64) -> str:
    """A new epoch of `run_id` training from `from_step`; returns its id. Epochs beyond `keep`
    are forgotten oldest first (their records are long consumed)."""
    epoch = Epoch(secrets.token_hex(8), from_step)
    while True:
        entry = await kv.entry(run_id)
        epochs = [*parse(entry.value if entry else None), epoch][-keep:]
        value = json.dumps([asdict(e) for e in epochs]).encode()
        try:
            if entry is None:
                await kv.create(run_id, value)
            else:
                await kv.update(run_id, value, entry.revision)
            return epoch.id
        except KVConflict:
            continue


async def read(kv: KV, run_id: str) -> list[Epoch]:
    return parse(await kv.get(run_id))
