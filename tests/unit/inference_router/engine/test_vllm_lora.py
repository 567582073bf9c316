"""vLLM's LoRA mapping, checked against the pinned vLLM's sources: a deployment serving LoRA runs
starts vLLM with enable_lora, max_loras and a max_lora_rank vLLM accepts; each committed adapter
version is a PEFT directory vLLM's loader takes, requested by a LoRARequest of its own; a run's
requests carry its adapter and their tokens its adapter's version, beside base requests."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from services.inference_router.engine import vllm_engine, vllm_lora
from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.engine.vllm_args import (
    VLLM_LORA_RANKS,
    engine_args,
    lora_request_args,
    vllm_lora_rank,
)
from services.kit.config.recipe import DeploymentSpec
from services.kit.rpc.errors import FailedPrecondition
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, hf_params
from services.modeling.lora import PEFT_PREFIX, LoraSpec
from tests.support import vllm_side
from tests.support.vllm_double import RecordingAsyncLLM

CONFIG = ModelConfig.tiny(vocab_size=96, max_position_embeddings=128)
ADAPTER = CONFIG.with_lora(LoraSpec(8, 16.0, ("q_proj", "v_proj")))


def _class_fields(path: str, names: tuple[str, ...]) -> dict[str, ast.AnnAssign]:
    tree = ast.parse(vllm_side.source(path))
    return {
        node.target.id: node
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name in names
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def test_a_lora_deployment_starts_vllm_with_its_lora_arguments():
    fields = _class_fields("vllm/engine/arg_utils.py", ("EngineArgs", "AsyncEngineArgs"))
    ours = engine_args("/base", "auto", DeploymentSpec(backend="vllm", max_loras=3, max_lora_rank=12))
    assert {"enable_lora", "max_loras", "max_lora_rank"} <= set(ours) <= set(fields)
    assert (ours["enable_lora"], ours["max_loras"], ours["max_lora_rank"]) == (True, 3, 16)
    assert "enable_lora" not in engine_args("/base", "auto", DeploymentSpec(backend="vllm"))
    # the ranks vLLM accepts, read from its LoRA config
    literal = next(
        node.value
        for node in ast.parse(vllm_side.source("vllm/config/lora.py")).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MaxLoRARanks"
    )
    assert tuple(ast.literal_eval(e) for e in literal.slice.elts) == VLLM_LORA_RANKS
    with pytest.raises(ValueError, match="max_lora_rank"):
        vllm_lora_rank(1024)


def test_each_adapter_version_is_a_lora_request_vllm_takes():
    request = vllm_side.load("vllm.lora.request").LoRARequest(
        **lora_request_args("run-a", 7, 3, "/x/run-a/v7")
    )
    assert (request.lora_name, request.lora_int_id, request.lora_path) == ("run-a@7", 3, "/x/run-a/v7")


def _adapter_state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in hf_params(ADAPTER).items()}


def test_runs_requests_carry_their_adapter_at_its_version_beside_base_requests(monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_sampling_params", lambda **kw: SimpleNamespace(**kw))
    monkeypatch.setattr(vllm_engine, "tokens_prompt", lambda ids: {"prompt_token_ids": ids})
    monkeypatch.setattr(vllm_lora, "vllm_lora_request", vllm_side.load("vllm.lora.request").LoRARequest)
    llm = RecordingAsyncLLM(CONFIG, Layout(1, "fused", "bfloat16"))
    engine = vllm_engine.VLLMEngine(llm, CONFIG, 128, 16, False, 0, (), layout=Layout(1, "fused", "bfloat16"))
    states = {"run-a": _adapter_state(1), "run-b": _adapter_state(2)}

    async def run():
        with pytest.raises(FailedPrecondition, match="run-a"):
            await engine.generate([EngineRequest([1, 2], SamplingParams(max_tokens=2), adapter="run-a")])
        await engine.serve_adapter("run-a", 3, ADAPTER, states["run-a"])
        await engine.serve_adapter("run-b", 5, ADAPTER, states["run-b"])
        with pytest.raises(FailedPrecondition) as refused:  # naming none of the runs it serves
            await engine.generate([EngineRequest([1, 2], SamplingParams(max_tokens=2), adapter="run-c")])
        assert "run-a" not in str(refused.value) and "run-b" not in str(refused.value)
        with pytest.raises(FailedPrecondition, match="older"):
            await engine.serve_adapter("run-b", 4, ADAPTER, states["run-b"])
        requests = [
            EngineRequest([1, 2, 3], SamplingParams(max_tokens=3), adapter="run-a"),
            EngineRequest([1, 2, 3], SamplingParams(max_tokens=3), adapter="run-b"),
            EngineRequest([1, 2, 3], SamplingParams(max_tokens=3)),
        ]
        return await engine.generate(requests)

    results = asyncio.run(run())
    assert [r.completions[0].weight_version for r in results] == [3, 5, 0]
    assert [set(r.completions[0].token_versions) for r in results] == [{3}, {5}, {0}]
    sent = {lr.lora_name: lr for lr in llm.lora_requests if lr is not None}
    assert set(sent) == {"run-a@3", "run-b@5"} and llm.lora_requests[-1] is None
    assert len({lr.lora_int_id for lr in sent.values()}) == 2
    # What vLLM loads from each path: the run's adapter in PEFT's names, and a config vLLM takes.
    required = [
        name
        for name, node in _class_fields("vllm/lora/peft_helper.py", ("PEFTHelper",)).items()
        if node.value is None
    ]
    for run, version in (("run-a", 3), ("run-b", 5)):
        path = sent[f"{run}@{version}"].lora_path
        config = json.loads(Path(path, "adapter_config.json").read_text())
        assert set(required) <= set(config) and config["r"] == 8 and config["lora_alpha"] == 16.0
        assert config["bias"] == "none" and not config["use_dora"] and config["modules_to_save"] is None
        saved = load_file(f"{path}/adapter_model.safetensors")
        assert set(saved) == {PEFT_PREFIX + name for name in states[run]}
        for name, tensor in states[run].items():
            assert torch.equal(saved[PEFT_PREFIX + name], tensor)
