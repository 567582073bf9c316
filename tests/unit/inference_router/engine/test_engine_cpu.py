"""The embedded CPU engine on a tiny Qwen2: batching, sampling params, weight swaps, errors."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.engine.cpu import CPUEngine
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout
from services.modeling.logprobs import token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM

CONFIG = ModelConfig.tiny(vocab_size=97, max_position_embeddings=128)


@pytest.fixture(scope="module")
def reference() -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM(CONFIG, seed=3).eval()


def _engine(model: Qwen2ForCausalLM, **kw) -> CPUEngine:
    return CPUEngine.create(CONFIG, model.hf_state_dict(), version=5, **kw)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [
        torch.randint(
            0, CONFIG.vocab_size, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen
        ).tolist()
        for _ in range(n)
    ]


async def test_logprobs_match_plain_forward(reference: Qwen2ForCausalLM) -> None:
    engine = _engine(reference, layout=Layout(naming="fused"))
    try:
        params = SamplingParams(temperature=0.8, max_tokens=10, seed=7)
        [result] = await engine.generate([EngineRequest(_prompts(1)[0], params)])
        comp = result.completions[0]
        assert comp.weight_version == 5 and len(comp.token_ids) == 10 and comp.finish_reason == "length"
        ids = torch.tensor(_prompts(1)[0] + comp.token_ids)
        with torch.no_grad():
            logits = reference(ids)
        ref = token_logprobs(logits, ids, torch.tensor([0, len(ids)]), temperature=0.8)[-10:]
        assert torch.allclose(torch.tensor(comp.logprobs), ref, atol=1e-4)
    finally:
        await engine.close()


async def test_continuous_batching_equals_sequential_greedy(reference: Qwen2ForCausalLM) -> None:
    prompts = _prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i) for i in range(6)]
    engine = _engine(reference, max_batch_size=4)  # fewer slots than requests: some wait for a slot
    try:
        sequential = [
            (await engine.generate([EngineRequest(p, s)]))[0].completions[0]
            for p, s in zip(prompts, params, strict=True)
        ]

        async def staggered(i: int):
            await asyncio.sleep(0.005 * i)  # arrive while others are mid-decode
            return (await engine.generate([EngineRequest(prompts[i], params[i])]))[0].completions[0]

        concurrent = await asyncio.gather(*(staggered(i) for i in range(6)))
        for a, b in zip(sequential, concurrent, strict=True):
            assert a.token_ids == b.token_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
        assert engine.status().extra["steps"] < sum(p.max_tokens for p in params) * 2
    finally:
        await engine.close()


async def test_n_seed_stop_and_stream(reference: Qwen2ForCausalLM) -> None:
    engine = _engine(reference)
    try:
        prompt = _prompts(1)[0]
        params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=12, n=3, seed=123)
        [a] = await engine.generate([EngineRequest(prompt, params)])
        [b] = await engine.generate([EngineRequest(prompt, params)])
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
        assert len({tuple(c.token_ids) for c in a.completions}) > 1  # n samples differ (seed + index)

        stop = a.completions[0].token_ids[3]
        [s] = await engine.generate(
            [EngineRequest(prompt, SamplingParams(**{**params.__dict__, "n": 1, "stop_token_ids": (stop,)}))]
        )
        first = a.completions[0].token_ids
        assert s.completions[0].finish_reason == "stop"
        assert s.completions[0].token_ids == first[: first.index(stop) + 1]

        chunks = [c async for c in engine.generate_stream(EngineRequest(prompt, params))]
        for i in range(3):
            mine = [c for c in chunks if c.index == i]
            assert [t for c in mine for t in c.token_ids] == a.completions[i].token_ids
            assert mine[-1].finish_reason == "length"
    finally:
        await engine.close()


async def test_weight_swap_between_steps(reference: Qwen2ForCausalLM) -> None:
    engine = _engine(reference)
    other = Qwen2ForCausalLM(CONFIG, seed=4)
    try:
        prompt = _prompts(1)[0]
        long = asyncio.ensure_future(
            engine.generate([EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=40))])
        )
        while engine.status().extra["generated_tokens"] < 3:
            await asyncio.sleep(0.001)
        await engine.load_weights(6, other.hf_state_dict())
        [res] = await long
        versions = res.completions[0].token_versions
        assert versions[0] == 5 and versions[-1] == 6 and versions == sorted(versions)
        assert res.completions[0].weight_version == 5  # the oldest version that produced a token
        [after] = await engine.generate([EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=3))])
        assert after.completions[0].weight_version == 6
        with pytest.raises(ValueError):
            await engine.load_weights(7, {"model.embed_tokens.weight": torch.zeros(3)})
        assert engine.version == 6
    finally:
        await engine.close()


async def test_rollback_goes_back_only_when_asked(reference: Qwen2ForCausalLM) -> None:
    engine = _engine(reference)  # serves version 5
    bad = {k: v * 100 for k, v in reference.hf_state_dict().items()}
    try:
        prompt = _prompts(1)[0]
        greedy = SamplingParams(temperature=0, max_tokens=6)
        [before] = await engine.generate([EngineRequest(prompt, greedy)])
        await engine.load_weights(6, bad)
        with pytest.raises(FailedPrecondition):  # a plain load never goes backwards
            await engine.load_weights(5, reference.hf_state_dict())
        await engine.rollback(5, reference.hf_state_dict())
        [after] = await engine.generate([EngineRequest(prompt, greedy)])
        assert engine.version == 5 and after.completions[0].weight_version == 5
        assert after.completions[0].token_ids == before.completions[0].token_ids
        assert after.completions[0].logprobs == pytest.approx(before.completions[0].logprobs, abs=1e-5)
    finally:
        await engine.close()


async def test_bad_requests_fail_and_engine_keeps_serving(reference: Qwen2ForCausalLM) -> None:
    engine = _engine(reference, max_model_len=64)
    try:
        for prompt, params, field in [
            ([], SamplingParams(), "prompt_token_ids"),
            ([1, 97], SamplingParams(), "prompt_token_ids"),
            ([1], SamplingParams(temperature=-1), "sampling.temperature"),
            ([1], SamplingParams(max_tokens=64), "sampling.max_tokens"),
        ]:
            with pytest.raises(InvalidArgument, match=field):
                await engine.generate([EngineRequest(prompt, params)])
        [ok] = await engine.generate([EngineRequest([1, 2], SamplingParams(max_tokens=2))])
        assert len(ok.completions[0].token_ids) == 2
    finally:
        await engine.close()


async def test_backpressure_abort_and_close(reference: Qwen2ForCausalLM) -> None:
    from services.inference_router.engine.scheduler import SchedulerLimits
    from services.kit.rpc.errors import ResourceExhausted

    engine = _engine(reference, max_batch_size=1, limits=SchedulerLimits(max_waiting_requests=2))
    try:
        engine.pause()  # nothing is admitted: the queue fills
        queued = [
            asyncio.ensure_future(engine.generate([EngineRequest([1, 2], SamplingParams(max_tokens=3))]))
            for _ in range(2)
        ]
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match="queue full"):
            await engine.generate([EngineRequest([1, 2], SamplingParams(max_tokens=3))])
        assert engine.status().queued_requests == 2 and engine.status().paused
        engine.resume()
        assert all(r.completions[0].finish_reason == "length" for [r] in await asyncio.gather(*queued))

        # A stream whose consumer leaves stops generating and frees its slot.
        stream = engine.generate_stream(EngineRequest([1, 2], SamplingParams(max_tokens=50)))
        first = await stream.__anext__()
        assert len(first.token_ids) == 1
        await stream.aclose()
        assert engine.status().running_sequences == 0
        [ok] = await engine.generate([EngineRequest([3], SamplingParams(max_tokens=2))])
        assert len(ok.completions[0].token_ids) == 2

        # close() finishes in-flight requests with "abort", keeping the tokens sampled so far.
        pending = asyncio.ensure_future(engine.generate([EngineRequest([1], SamplingParams(max_tokens=60))]))
        while engine.status().extra["generated_tokens"] < 10:
            await asyncio.sleep(0.001)
    finally:
        await engine.close()
    [aborted] = await pending
    assert aborted.completions[0].finish_reason == "abort" and aborted.completions[0].token_ids
