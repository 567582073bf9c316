"""The vLLM backend behind the Engine interface (GPU only; skipped elsewhere), through vLLM's own
weight-transfer API and looprl's backend in every worker:

- log-probs under the tempered untruncated distribution match a plain forward, before and after a
  swap (the prompt is long enough that vLLM caches its blocks: reusing KV computed under the old
  weights would show here);
- a corrupted transfer is refused on every rank and the served weights stay as they were;
- a request in flight through a swap ("keep" mode) carries the old version before it and the new
  one after it; that swap hands the ranks' tensors over as CUDA IPC handles;
- tp=2 (two GPUs): each worker receives its own rank's rectangles and the log-probs still match.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.kit.config.recipe import DeploymentSpec
from services.kit.rpc.errors import InvalidArgument
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, shard_state_dict
from services.modeling.logprobs import token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.weights.errors import ChecksumMismatch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CONFIG = ModelConfig.tiny(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
)
PROMPT = [(7 * i + 5) % 250 for i in range(48)]  # three full KV blocks of 16: prefix-cached


def _reference(
    model: Qwen2ForCausalLM, prompt: list[int], tokens: list[int], temperature: float
) -> torch.Tensor:
    ids = torch.tensor(prompt + tokens)
    with torch.no_grad():
        logits = model(ids)
    return token_logprobs(logits, ids, torch.tensor([0, len(ids)]), temperature or 1.0)[len(prompt) :]


def _shards(model: Qwen2ForCausalLM, tp: int) -> list[dict[str, torch.Tensor]]:
    layout = Layout(tp, "fused", "float32")
    return [shard_state_dict(model.hf_state_dict(), CONFIG, layout, r) for r in range(tp)]


async def _engine(tmp_path, tp: int):
    from services.inference_router.engine.vllm_engine import VLLMEngine

    spec = DeploymentSpec(
        backend="vllm",
        model_path=str(tmp_path),
        dtype="float32",
        max_model_len=192,
        tensor_parallel=tp,
        gpu_memory_utilization=0.2,
    )
    return await VLLMEngine.create(CONFIG, spec)


async def _check_matches(engine, model, version) -> None:
    for temperature in (0.0, 0.7):
        req = EngineRequest(PROMPT, SamplingParams(temperature=temperature, max_tokens=12, seed=3))
        [res] = await engine.generate([req])
        comp = res.completions[0]
        assert comp.weight_version == version and len(comp.token_ids) == 12
        ref = _reference(model, PROMPT, comp.token_ids, temperature)
        assert torch.allclose(torch.tensor(comp.logprobs), ref, atol=2e-3), torch.tensor(comp.logprobs) - ref


@pytest.mark.parametrize("tp", [1, 2])
async def test_vllm_swaps_weights_through_its_weight_transfer_api(tmp_path, tp) -> None:
    pytest.importorskip("vllm")
    if torch.cuda.device_count() < tp:
        pytest.skip(f"tp={tp} needs {tp} GPUs")
    v0, v1, v2 = (Qwen2ForCausalLM(CONFIG, seed=s).eval() for s in (0, 1, 2))
    v0.save_pretrained(tmp_path)
    engine = await _engine(tmp_path, tp)
    try:
        await _check_matches(engine, v0, 0)
        await engine.swap(1, _shards(v1, tp))
        await _check_matches(engine, v1, 1)  # same prompt: no KV block of v0 may be reused

        import services.inference_router.engine.vllm_engine as mod

        real = mod.manifest_of

        def corrupting(version, state, row_starts=None):
            handoff = real(version, state, row_starts)
            handoff.segment.buf[handoff.update_info["params"][0]["offset"]] ^= 0xFF
            return handoff

        mod.manifest_of = corrupting
        try:
            with pytest.raises(Exception, match="hash64") as info:
                await engine.swap(2, _shards(v2, tp))
            assert "hash64" in str(info.value) or isinstance(info.value, ChecksumMismatch)
        finally:
            mod.manifest_of = real
        assert engine.version == 1
        await _check_matches(engine, v1, 1)  # nothing of version 2 reached any rank

        # a request in flight through the swap to version 2, whose rank tensors are already on the
        # GPUs: they travel as CUDA IPC handles (vllm_handoff "cuda_ipc"), copied device to device
        long = EngineRequest(PROMPT, SamplingParams(temperature=1.0, max_tokens=120, seed=5))
        task = asyncio.create_task(engine.generate([long]))
        await asyncio.sleep(0.05)
        on_gpu = [{k: v.cuda(r) for k, v in shard.items()} for r, shard in enumerate(_shards(v2, tp))]
        await engine.swap(2, on_gpu)
        [res] = await task
        versions = res.completions[0].token_versions
        assert versions == sorted(versions) and set(versions) <= {1, 2}, versions
        assert res.completions[0].weight_version == min(versions)
        await _check_matches(engine, v2, 2)
        print(f"tp={tp} swap seconds per version: {engine.swap_seconds}")

        with pytest.raises(InvalidArgument, match=r"sampling\.top_p"):
            await engine.generate([EngineRequest(PROMPT, SamplingParams(temperature=1.0, top_p=0.9))])
    finally:
        await engine.close()
