"""Parity: engine log-probs (tp=1 in-process, tp=2 across Ray actors with gloo) equal a plain forward
of the same weights in services/modeling Qwen2ForCausalLM and in transformers, within 1e-4 (fp32)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.engine.cpu import CPUEngine
from services.inference_router.engine.tp import TPEngine
from services.kit.rpc.errors import InvalidArgument
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout
from services.modeling.logprobs import token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM

# 4 heads / 2 kv heads: tp=2 splits kv heads; intermediate 128 splits evenly. Untied lm_head too.
CONFIG = ModelConfig.tiny(vocab_size=89, max_position_embeddings=96, tie_word_embeddings=False)
PROMPTS = [[3, 14, 15, 9, 26], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6], [1]]
TEMPS = [1.0, 0.7, 0.0, 1.3]


@pytest.fixture(scope="module")
def reference() -> Qwen2ForCausalLM:
    return Qwen2ForCausalLM(CONFIG, seed=21).eval()


def _requests(max_tokens: int = 8) -> list[EngineRequest]:
    return [
        EngineRequest(p, SamplingParams(temperature=t, max_tokens=max_tokens, seed=100 + i))
        for i, (p, t) in enumerate(zip(PROMPTS, TEMPS, strict=True))
    ]


def _reference_logprobs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], temperature: float, hf: bool
) -> torch.Tensor:
    ids = torch.tensor(prompt + tokens)
    with torch.no_grad():
        logits = model(ids[None]).logits[0] if hf else model(ids)
    lp = token_logprobs(logits, ids, torch.tensor([0, len(ids)]), temperature=temperature or 1.0)
    return lp[len(prompt) :]


def _transformers_model(model: Qwen2ForCausalLM):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.Qwen2Config(**CONFIG.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    hf = transformers.Qwen2ForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


def _check_parity(results, model, hf_model) -> None:
    for req, res in zip(_requests(), results, strict=True):
        comp = res.completions[0]
        assert len(comp.token_ids) == req.sampling.max_tokens
        got = torch.tensor(comp.logprobs)
        ours = _reference_logprobs(
            model, req.prompt_token_ids, comp.token_ids, req.sampling.temperature, hf=False
        )
        theirs = _reference_logprobs(
            hf_model, req.prompt_token_ids, comp.token_ids, req.sampling.temperature, hf=True
        )
        assert torch.allclose(got, ours, atol=1e-4), (got - ours).abs().max()
        assert torch.allclose(got, theirs, atol=1e-4), (got - theirs).abs().max()


@pytest.mark.parametrize("naming", ["hf", "fused"])
async def test_tp1_logprobs_match_plain_forward(reference: Qwen2ForCausalLM, naming: str) -> None:
    engine = CPUEngine.create(CONFIG, reference.hf_state_dict(), 1, layout=Layout(naming=naming))
    try:
        results = await engine.generate(_requests())
        _check_parity(results, reference, _transformers_model(reference))
    finally:
        await engine.close()


@pytest.mark.slow
async def test_tp2_across_ray_actors_matches_plain_forward_and_tp1(
    ray_client, reference: Qwen2ForCausalLM
) -> None:
    layout = Layout(tp_size=2, naming="fused")
    engine = await TPEngine.create(CONFIG, layout, max_batch_size=4, max_model_len=64)
    tp1 = CPUEngine.create(CONFIG, reference.hf_state_dict(), 1, max_batch_size=4, max_model_len=64)
    try:
        assert not engine.status().ready
        await engine.load_weights(1, reference.hf_state_dict())
        assert engine.status().ready and engine.version == 1
        # Rank 0 really holds only its half of the column-parallel weights.
        qkv = engine.rank0.model.params["model.layers.0.self_attn.qkv_proj.weight"]
        assert qkv.shape[0] == (CONFIG.q_size + 2 * CONFIG.kv_size) // 2

        results = await engine.generate(_requests())  # all four join one running batch
        _check_parity(results, reference, _transformers_model(reference))

        # Greedy tokens equal tp=1 and equal sequential generation (continuous batching changes nothing).
        greedy = [
            EngineRequest(p, SamplingParams(temperature=0, max_tokens=6 + i)) for i, p in enumerate(PROMPTS)
        ]
        batched = await asyncio.gather(*(engine.generate([r]) for r in greedy))
        sequential = [await tp1.generate([r]) for r in greedy]
        for (a,), (b,) in zip(batched, sequential, strict=True):
            assert a.completions[0].token_ids == b.completions[0].token_ids

        # A weight swap reaches every rank together: parity holds against the new weights.
        newer = Qwen2ForCausalLM(CONFIG, seed=22).eval()
        await engine.load_weights(2, newer.hf_state_dict())
        results = await engine.generate(_requests())
        assert all(r.completions[0].weight_version == 2 for r in results)
        _check_parity(results, newer, _transformers_model(newer))

        with pytest.raises(InvalidArgument, match="prompt_token_ids"):
            await engine.generate([EngineRequest([CONFIG.vocab_size], SamplingParams())])
        [ok] = await engine.generate([EngineRequest([1, 2], SamplingParams(max_tokens=2))])
        assert ok.completions[0].finish_reason == "length"
    finally:
        await tp1.close()
        await engine.close()
