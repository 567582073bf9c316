"""The vLLM backend behind the Engine interface (GPU only; skipped elsewhere): log-probs under the
tempered untruncated distribution match a plain forward, and a weight update reaches the workers."""

from __future__ import annotations

import pytest
import torch

from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.replica import ReplicaSettings
from services.kit.errors import InvalidArgument
from services.modeling.config import ModelConfig
from services.modeling.logprobs import token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM

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


def _reference(
    model: Qwen2ForCausalLM, prompt: list[int], tokens: list[int], temperature: float
) -> torch.Tensor:
    ids = torch.tensor(prompt + tokens)
    with torch.no_grad():
        logits = model(ids)
    return token_logprobs(logits, ids, torch.tensor([0, len(ids)]), temperature or 1.0)[len(prompt) :]


async def test_vllm_logprobs_and_weight_update(tmp_path) -> None:
    pytest.importorskip("vllm")
    from services.inference_router.engine.vllm_engine import VLLMEngine

    v0, v1 = Qwen2ForCausalLM(CONFIG, seed=0).eval(), Qwen2ForCausalLM(CONFIG, seed=1).eval()
    v0.save_pretrained(tmp_path)
    settings = ReplicaSettings(backend="vllm", model_path=str(tmp_path), dtype="float32", max_model_len=128)
    settings.gpu_memory_utilization = 0.2  # type: ignore[attr-defined]
    engine = await VLLMEngine.create(CONFIG, str(tmp_path), settings)
    try:
        prompt = [5, 17, 99, 3]
        for model, version in ((v0, 0), (v1, 1)):
            if version:
                await engine.load_weights(1, v1.hf_state_dict())
            for temperature in (0.0, 0.7):
                req = EngineRequest(prompt, SamplingParams(temperature=temperature, max_tokens=12, seed=3))
                [res] = await engine.generate([req])
                comp = res.completions[0]
                assert comp.weight_version == version and len(comp.token_ids) == 12
                ref = _reference(model, prompt, comp.token_ids, temperature)
                assert torch.allclose(torch.tensor(comp.logprobs), ref, atol=2e-3), (
                    torch.tensor(comp.logprobs) - ref
                )
        with pytest.raises(InvalidArgument, match=r"sampling\.top_p"):
            await engine.generate([EngineRequest(prompt, SamplingParams(temperature=1.0, top_p=0.9))])
    finally:
        await engine.close()
