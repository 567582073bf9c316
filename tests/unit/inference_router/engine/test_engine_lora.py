"""The CPU engine serves several LoRA adapters over one base at once: each request samples with its
own adapter at that adapter's version, in batches shared with other adapters and the bare base, and
what it samples has the log-probs the trainer's model with that adapter gives."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.engine.cpu import CPUEngine
from services.kit.rpc.errors import FailedPrecondition
from services.modeling.config import ModelConfig
from services.modeling.logprobs import token_logprobs
from services.modeling.lora import LoraSpec, adapter_state_dict, inject
from services.modeling.qwen2 import Qwen2ForCausalLM

CONFIG = ModelConfig.tiny(max_position_embeddings=128)
SPEC = LoraSpec(4, 8.0, ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
PROMPT = [3, 14, 15, 9, 26, 5]


def _policy(seed: int) -> tuple[Qwen2ForCausalLM, dict[str, torch.Tensor]]:
    """The base with an adapter of its own (B drawn away from zero, so adapters differ)."""
    model = Qwen2ForCausalLM(CONFIG, seed=1).eval()
    inject(model, SPEC, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(seed * 100 + len(name)))
    return model, {k: v.detach().clone() for k, v in adapter_state_dict(model).items()}


def _base_state() -> dict[str, torch.Tensor]:
    return Qwen2ForCausalLM(CONFIG, seed=1).hf_state_dict()


def _request(adapter: str, seed: int) -> EngineRequest:
    return EngineRequest(
        PROMPT, SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=seed), adapter=adapter
    )


async def test_requests_of_two_adapters_and_the_base_share_batches_each_with_its_own_weights_and_version():
    (policy_a, adapter_a), (policy_b, adapter_b) = _policy(7), _policy(8)
    engine = CPUEngine.create(CONFIG, _base_state(), version=0, max_batch_size=8, max_model_len=64)
    try:
        adapter_config = CONFIG.with_lora(SPEC)
        await engine.serve_adapter("run-a", 3, adapter_config, adapter_a)
        await engine.serve_adapter("run-b", 5, adapter_config, adapter_b)
        results = await engine.generate([_request("run-a", 11), _request("run-b", 12), _request("", 13)])
        base = Qwen2ForCausalLM(CONFIG, seed=1).eval()
        for result, model, version in zip(results, (policy_a, policy_b, base), (3, 5, 0), strict=True):
            for completion in result.completions:
                assert completion.weight_version == version and set(completion.token_versions) == {version}
                ids = torch.tensor(PROMPT + completion.token_ids)
                with torch.no_grad():
                    ref = token_logprobs(model(ids), ids, torch.tensor([0, len(ids)]))
                torch.testing.assert_close(
                    torch.tensor(completion.logprobs), ref[len(PROMPT) :], atol=1e-4, rtol=0
                )
        # Batch invariance: a request samples the same alone as beside the other adapters' requests.
        [alone] = await engine.generate([_request("run-a", 11)])
        assert [c.token_ids for c in alone.completions] == [c.token_ids for c in results[0].completions]
        assert [c.logprobs for c in alone.completions] == [c.logprobs for c in results[0].completions]

        # A new version of one adapter leaves the other's version alone.
        await engine.serve_adapter("run-b", 6, adapter_config, adapter_a)
        assert engine.adapter_versions == {"run-a": 3, "run-b": 6}
        [again] = await engine.generate([_request("run-b", 11)])
        assert [c.token_ids for c in again.completions] == [c.token_ids for c in alone.completions]
        assert {c.weight_version for c in again.completions} == {6}
    finally:
        await engine.close()


async def test_unknown_adapters_and_stale_adapter_versions_are_refused():
    _, adapter = _policy(7)
    engine = CPUEngine.create(CONFIG, _base_state(), version=0, max_batch_size=4, max_model_len=64)
    try:
        with pytest.raises(FailedPrecondition, match="adapter: 'run-x' is not served"):
            await engine.generate([_request("run-x", 1)])
        await engine.serve_adapter("run-a", 4, CONFIG.with_lora(SPEC), adapter)
        # A shared replica serves other tenants' runs: a refusal names none of them.
        with pytest.raises(FailedPrecondition) as refused:
            await engine.generate([_request("run-x", 1)])
        assert "run-a" not in str(refused.value)
        with pytest.raises(FailedPrecondition, match="older"):
            await engine.serve_adapter("run-a", 3, CONFIG.with_lora(SPEC), adapter)
        wrong = CONFIG.replace(hidden_size=32, head_dim=8).with_lora(SPEC)
        with pytest.raises(ValueError, match="not a LoRA adapter of this model"):
            await engine.serve_adapter("run-b", 1, wrong, adapter)
        assert engine.adapter_versions == {"run-a": 4}
    finally:
        await engine.close()


async def test_dropping_an_adapter_aborts_its_requests_and_leaves_the_others_running():
    (_, adapter_a), (_, adapter_b) = _policy(7), _policy(8)
    engine = CPUEngine.create(CONFIG, _base_state(), version=0, max_batch_size=8, max_model_len=64)
    try:
        for name, state in (("run-a", adapter_a), ("run-b", adapter_b)):
            await engine.serve_adapter(name, 1, CONFIG.with_lora(SPEC), state)
        long = SamplingParams(temperature=1.0, max_tokens=40, n=1, seed=3)
        a = asyncio.create_task(engine.generate([EngineRequest(PROMPT, long, adapter="run-a")]))
        b = asyncio.create_task(engine.generate([EngineRequest(PROMPT, long, adapter="run-b")]))
        while engine.steps < 3:
            await asyncio.sleep(0.01)
        engine.drop_adapter("run-a")
        [done_a], [done_b] = await a, await b
        assert done_a.completions[0].finish_reason == "abort"
        assert done_b.completions[0].finish_reason in ("stop", "length")
        with pytest.raises(FailedPrecondition, match="run-a"):
            await engine.generate([_request("run-a", 1)])
    finally:
        await engine.close()


async def test_an_adapter_dropped_while_a_step_uses_it_ends_only_its_own_requests():
    """The drop lands while a decode step holding the adapter's sequence runs in the worker thread:
    that step still finds the adapter, and the other run's request continues."""
    (_, adapter_a), (_, adapter_b) = _policy(7), _policy(8)
    engine = CPUEngine.create(CONFIG, _base_state(), version=0, max_batch_size=8, max_model_len=64)
    try:
        for name, state in (("run-a", adapter_a), ("run-b", adapter_b)):
            await engine.serve_adapter(name, 1, CONFIG.with_lora(SPEC), state)
        model = engine.executor.model
        decode, inside, release = model.decode, threading.Event(), threading.Event()

        def held_decode(*args, **kwargs):
            if engine.steps == 2:
                inside.set()
                release.wait(10)
            return decode(*args, **kwargs)

        model.decode = held_decode
        long = SamplingParams(temperature=1.0, max_tokens=40, n=1, seed=3)
        a = asyncio.create_task(engine.generate([EngineRequest(PROMPT, long, adapter="run-a")]))
        b = asyncio.create_task(engine.generate([EngineRequest(PROMPT, long, adapter="run-b")]))
        assert await asyncio.to_thread(inside.wait, 10)
        engine.drop_adapter("run-a")
        release.set()
        [done_a], [done_b] = await a, await b
        assert done_a.completions[0].finish_reason == "abort"
        assert done_b.completions[0].finish_reason in ("stop", "length")
        assert "run-a" not in model.adapters
    finally:
        await engine.close()
