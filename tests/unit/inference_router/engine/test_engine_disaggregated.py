"""The CPU engine as a disaggregated deployment's workers: a prefill worker hands a prompt's KV over,
a decode worker continues from it with the tokens and log-probs a co-located engine samples; KV of
another weight version is never decoded (recomputed instead, and recorded per token); the KV blob
is read once, checked, and cleaned up."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from bench.harness.synthetic_weights import random_state
from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.engine.cpu import CPUEngine
from services.inference_router.engine.disaggregated import DisaggregatedEngine, KVRequest
from services.inference_router.engine.kv_transfer import (
    KVStore,
    KVUnavailable,
    check_kv_id,
    decode,
    encode,
    take_local,
)
from services.modeling.config import ModelConfig

CONFIG = ModelConfig.tiny(vocab_size=97, max_position_embeddings=128)
V0, V1 = random_state(CONFIG, seed=1), random_state(CONFIG, seed=2)


def _requests() -> list[EngineRequest]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(6):
        prompt = torch.randint(1, CONFIG.vocab_size, (3 + 5 * i,), generator=gen).tolist()
        greedy = i % 3 == 0
        params = SamplingParams(
            temperature=0.0 if greedy else 0.9, max_tokens=6 + i, n=1 + i % 3, seed=None if greedy else 40 + i
        )
        out.append(EngineRequest(prompt, params, request_id=f"r{i}"))
    return out


def _pair(tmp_path, **kw) -> tuple[DisaggregatedEngine, DisaggregatedEngine]:
    store = KVStore(directory=tmp_path)
    prefill = DisaggregatedEngine.create(CONFIG, V0, 0, kv_store=store, max_model_len=96, **kw)
    decode_ = DisaggregatedEngine.create(
        CONFIG, V0, 0, kv_store=KVStore(directory=tmp_path), max_model_len=96, **kw
    )
    return prefill, decode_


async def _hand_over(prefill: DisaggregatedEngine, requests, tmp_path) -> list[KVRequest]:
    handles = await asyncio.gather(*(prefill.prefill_for_transfer(r) for r in requests))
    return [
        KVRequest(
            r.prompt_token_ids,
            r.sampling,
            request_id=r.request_id,
            kv=decode(take_local(h.kv_id, tmp_path), r.prompt_token_ids),
        )
        for r, h in zip(requests, handles, strict=True)
    ]


def _same(expected, got, exact: bool) -> None:
    for want, have in zip(expected, got, strict=True):
        assert [c.token_ids for c in have.completions] == [c.token_ids for c in want.completions]
        for a, b in zip(have.completions, want.completions, strict=True):
            if exact:
                assert a.logprobs == b.logprobs  # bit for bit
            else:
                assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
            assert a.kv_versions == a.token_versions == [0] * len(a.token_ids)


async def test_a_decode_worker_samples_what_a_colocated_engine_samples(tmp_path):
    """Bit for bit when the decode batches are the co-located engine's; when other requests share
    them, the same tokens and log-probs up to float32 rounding, as the co-located engine itself
    gives across batch compositions (the row order inside a matmul changes its rounding)."""
    requests = _requests()
    colocated = CPUEngine.create(CONFIG, V0, 0, max_model_len=96)
    prefill, decode_ = _pair(tmp_path)
    try:
        expected = await colocated.generate(requests)
        continued = await _hand_over(prefill, requests, tmp_path)
        _same(expected, await decode_.generate(continued), exact=True)
        # Continued requests share the decode worker's batch with ordinary ones, as they would.
        continued = await _hand_over(prefill, requests, tmp_path)
        _same([*expected, *expected[:2]], await decode_.generate([*continued, *requests[:2]]), exact=False)
        assert not any(r.recomputed for r in continued)
        assert decode_.status().extra["kv_imported"] == 2 * len(requests)
        prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
        ordinary = sum(len(r.prompt_token_ids) for r in requests[:2])
        assert decode_.status().extra["prefill_tokens"] == ordinary  # it computed no handed-over prompt
        exported = prefill.status().extra
        assert exported["kv_exported"] == 2 * len(requests) and exported["decode_steps"] == 0
        assert exported["prefill_tokens"] == 2 * prompt_tokens
        assert list(tmp_path.iterdir()) == []  # every blob was read once and is gone
    finally:
        for engine in (colocated, prefill, decode_):
            await engine.close()


async def test_kv_of_another_version_is_recomputed_never_decoded(tmp_path):
    requests = _requests()[:3]
    prefill, decode_ = _pair(tmp_path)
    reference = CPUEngine.create(CONFIG, V1, 1, max_model_len=96)
    try:
        continued = await _hand_over(prefill, requests, tmp_path)  # made under version 0
        await decode_.load_weights(1, V1)
        got = await decode_.generate(continued)
        assert [r.recomputed for r in continued] == ["version"] * 3
        expected = await reference.generate(requests)
        for want, have in zip(expected, got, strict=True):
            assert [c.token_ids for c in have.completions] == [c.token_ids for c in want.completions]
            assert all(c.kv_versions == c.token_versions == [1] * len(c.token_ids) for c in have.completions)
        assert decode_.status().extra["kv_recomputed_version"] == 3
    finally:
        for engine in (prefill, decode_, reference):
            await engine.close()


async def test_a_swap_recomputes_running_sequences_so_no_token_reads_older_kv(tmp_path):
    """A decode worker swaps weights mid-sequence: from then on each token is sampled from KV made
    under the new version (kv_versions == token_versions); a co-located engine decodes on from the
    old KV, and says so."""
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0.0, max_tokens=40)
    prefill, decode_ = _pair(tmp_path)
    colocated = CPUEngine.create(CONFIG, V0, 0, max_model_len=96)
    try:
        [continued] = await _hand_over(prefill, [EngineRequest(prompt, params)], tmp_path)

        async def swap_when_running(engine):
            while engine.status().running_sequences == 0 or engine.steps < 5:
                await asyncio.sleep(0.001)
            await engine.load_weights(1, V1)

        disagg, _ = await asyncio.gather(decode_.generate([continued]), swap_when_running(decode_))
        colo, _ = await asyncio.gather(
            colocated.generate([EngineRequest(prompt, params)]), swap_when_running(colocated)
        )
        [d], [c] = disagg[0].completions, colo[0].completions
        assert set(d.token_versions) == {0, 1} and d.kv_versions == d.token_versions
        assert decode_.status().extra["recompute_tokens"] > len(prompt)
        assert set(c.token_versions) == {0, 1} and set(c.kv_versions) == {0}  # stale KV, recorded
    finally:
        for engine in (prefill, decode_, colocated):
            await engine.close()


def test_a_blob_is_used_only_intact_and_for_its_own_prompt(tmp_path):
    keys, values = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    logits = torch.randn(97)
    prompt = [1, 2, 3, 4, 5]
    blob = encode(keys, values, logits, 3, prompt)
    kv = decode(bytearray(blob), prompt)
    assert kv.version == 3 and torch.equal(kv.keys, keys) and torch.equal(kv.logits, logits)
    with pytest.raises(KVUnavailable, match="another prompt"):
        decode(bytearray(blob), [1, 2, 3, 4, 6])
    corrupt = bytearray(blob)
    corrupt[-3] ^= 0xFF
    with pytest.raises(KVUnavailable, match="checksum"):
        decode(corrupt, prompt)
    with pytest.raises(KVUnavailable, match="payload bytes"):
        decode(blob[:-4], prompt)
    for name in (
        "../etc/passwd",
        "looprl-kv-1-abc",
        "looprl-ws-1-" + "0" * 32,
        "/dev/shm/looprl-kv-1-" + "0" * 32,
    ):
        with pytest.raises(KVUnavailable, match="not a KV blob name"):
            check_kv_id(name)


def test_the_store_hands_each_blob_out_once_and_expires_the_rest(tmp_path):
    store = KVStore(ttl_s=0.2, directory=tmp_path)
    taken, kept = store.put(b"a" * 600), store.put(b"b" * 600)
    assert store.take(taken) == bytearray(b"a" * 600)
    with pytest.raises(KVUnavailable, match="not held here"):
        store.take(taken)
    time.sleep(0.3)
    assert store.sweep() == 1 and store.held == 0 and list(tmp_path.iterdir()) == []
    with pytest.raises(KVUnavailable, match="gone"):
        take_local(kept, tmp_path)
    store.put(b"c" * 600)
    store.close()  # a worker that stops removes what it still holds
    assert list(tmp_path.iterdir()) == []


def test_a_restarted_worker_removes_blobs_its_dead_predecessor_left(tmp_path):
    dead_pid = 2**22 + 12345  # above pid_max on stock kernels: no such process
    orphan = tmp_path / f"looprl-kv-{dead_pid}-{'a' * 32}"
    live = tmp_path / f"looprl-kv-{os.getppid()}-{'b' * 32}"
    for path in (orphan, live):
        path.write_bytes(b"x")
        os.utime(path, (1, 1))
    KVStore(ttl_s=60.0, directory=tmp_path)
    assert not orphan.exists() and live.exists()
