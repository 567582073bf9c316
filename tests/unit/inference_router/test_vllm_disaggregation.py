"""A disaggregated deployment on the vllm backend, checked on CPU against the pinned vLLM 0.33
sources (tests/support/vllm_side.py) and the recording AsyncLLM double:

- the deployment's setting becomes a KVTransferConfig vLLM's own class accepts (a connector vLLM
  ships and registers, kv_both, recompute on a failed load), passed to EngineArgs as that object;
- the router's two-phase request speaks vLLM's convention: the prefill leg's params are the keys
  NixlConnector reads, a request's params reach vLLM where its Request reads them
  (SamplingParams.extra_args) and survive vLLM's msgpack, the prefill instance's answer
  (RequestOutput.kv_transfer_params, with the keys NixlConnector's request_finished writes) goes
  back to the router unchanged, and only a request's first submission carries them.

What only a GPU shows (NIXL moving KV between two vLLM processes) is tools/gpu_check.sh's."""

from __future__ import annotations

import ast
import asyncio
import json
import re
from types import SimpleNamespace

from services.inference_router.engine import vllm_engine
from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.engine.vllm_args import engine_args, kv_transfer_config
from services.inference_router.two_phase import DO_REMOTE_DECODE
from services.kit.config.recipe import DeploymentSpec, DisaggregationSection
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout
from tests.support import vllm_side
from tests.support.vllm_double import RecordingAsyncLLM, _handed_over

CONFIG = ModelConfig.tiny(vocab_size=96, max_position_embeddings=128)
SPEC = DeploymentSpec(
    name="pd", backend="vllm", max_model_len=128, disaggregation=DisaggregationSection(prefill_workers=1)
)


def _fields(relative: str, class_names: tuple[str, ...]) -> set[str]:
    tree = ast.parse(vllm_side.source(relative))
    return {
        node.target.id
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name in class_names
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def test_the_deployment_becomes_a_kv_transfer_config_vllm_accepts():
    ours = kv_transfer_config(SPEC)
    config = vllm_side.load("vllm.config.kv_transfer").KVTransferConfig(**ours)
    assert config.is_kv_producer and config.is_kv_consumer  # either stage, per request
    assert config.kv_load_failure_policy == "recompute" and config.kv_connector == "NixlConnector"
    assert kv_transfer_config(DeploymentSpec(backend="vllm")) is None
    args = engine_args("/m", "dummy", SPEC)
    assert set(args) <= _fields("vllm/engine/arg_utils.py", ("EngineArgs", "AsyncEngineArgs"))
    assert args["kv_transfer_config"] == ours
    # Every connector the recipe offers is one vLLM registers under that name.
    registered = set(
        re.findall(
            r'register_connector\(\s*"(\w+)"',
            vllm_side.source("vllm/distributed/kv_transfer/kv_connector/factory.py"),
        )
    )
    offered = DisaggregationSection.model_fields["kv_connector"].annotation.__args__
    assert set(offered) <= registered


def test_create_hands_engine_args_the_config_object_and_a_side_channel_of_its_own(monkeypatch):
    """EngineArgs converts weight_transfer_config from a dict but not kv_transfer_config (read from
    arg_utils): create builds vLLM's KVTransferConfig itself, and gives the worker's engine core a
    NIXL side channel on its host and a port of its own."""
    source = vllm_side.source("vllm/engine/arg_utils.py")
    assert "isinstance(self.weight_transfer_config, dict)" in source
    assert "isinstance(self.kv_transfer_config, dict)" not in source
    kv_config = vllm_side.load("vllm.config.kv_transfer").KVTransferConfig
    llm, passed = RecordingAsyncLLM(CONFIG, Layout(1, "fused", "bfloat16")), []
    api = SimpleNamespace(
        AsyncEngineArgs=lambda **kw: passed.append(kw) or SimpleNamespace(**kw),
        AsyncLLM=SimpleNamespace(from_engine_args=lambda args: llm),
        WeightTransferInitRequest=lambda init_info: SimpleNamespace(init_info=init_info),
        KVTransferConfig=kv_config,
    )
    monkeypatch.setattr(vllm_engine, "vllm_api", lambda: api)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)

    async def run():
        engine = await vllm_engine.VLLMEngine.create(CONFIG, SPEC, side_channel_host="10.1.2.3")
        await engine.close()

    asyncio.run(run())
    [args] = passed
    assert isinstance(args["kv_transfer_config"], kv_config)
    import os

    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.2.3"
    assert int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"]) > 0
    envs = vllm_side.source("vllm/envs.py")
    assert '"VLLM_NIXL_SIDE_CHANNEL_HOST"' in envs and '"VLLM_NIXL_SIDE_CHANNEL_PORT"' in envs


def test_the_two_phase_params_are_the_ones_vllm_reads_and_writes():
    prefill_leg = json.loads(DO_REMOTE_DECODE)
    scheduler = vllm_side.source("vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py")
    assert 'params.get("do_remote_decode")' in scheduler and 'params.get("do_remote_prefill")' in scheduler
    assert prefill_leg["do_remote_decode"] is True and prefill_leg["do_remote_prefill"] is False
    # vLLM's Request takes them from SamplingParams.extra_args; the answer is on RequestOutput.
    request = vllm_side.source("vllm/v1/request.py")
    assert re.search(r"sampling_params\.extra_args\.get\(\s*\"kv_transfer_params\"", request)
    assert "extra_args" in _fields("vllm/sampling_params.py", ("SamplingParams",))
    outputs = ast.parse(vllm_side.source("vllm/outputs.py"))
    [init] = [
        f
        for c in outputs.body
        if isinstance(c, ast.ClassDef) and c.name == "RequestOutput"
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == "__init__"
    ]
    assert "kv_transfer_params" in [a.arg for a in init.args.args + init.args.kwonlyargs]
    # The double answers with the keys NixlConnector's pull scheduler writes (request_finished).
    pull = vllm_side.source("vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py")
    written = set(re.findall(r"^\s+(\w+)=", pull[pull.index("return delay_free_blocks, dict(") :], re.M))
    assert set(_handed_over("r", 3)) == written
    # The params survive vLLM's msgpack with their types (the engine core receives them so).
    serial = vllm_side.load("vllm.v1.serial_utils")
    for params in (prefill_leg, _handed_over("r", 3)):
        back = serial.MsgpackDecoder().decode(serial.MsgpackEncoder().encode(params))
        assert back == params and all(type(back[k]) is type(v) for k, v in params.items() if v is not None)


def test_a_prefill_leg_answers_with_the_connectors_params_and_a_continuation_carries_none(monkeypatch):
    monkeypatch.setattr(vllm_engine, "vllm_sampling_params", lambda **kw: SimpleNamespace(**kw))
    monkeypatch.setattr(vllm_engine, "tokens_prompt", lambda ids: {"prompt_token_ids": ids})
    llm = RecordingAsyncLLM(CONFIG, Layout(1, "fused", "bfloat16"))
    engine = vllm_engine.VLLMEngine(llm, CONFIG, 128, 16, False, 0, (), pause_mode="abort")

    async def run():
        prefill_leg = EngineRequest(
            [3, 4, 5],
            SamplingParams(max_tokens=1),
            request_id="p",
            kv_transfer_params=json.loads(DO_REMOTE_DECODE),
        )
        [answer] = await engine.generate([prefill_leg])
        decode_leg = EngineRequest(
            [3, 4, 5],
            SamplingParams(max_tokens=30),
            request_id="d",
            kv_transfer_params=answer.kv_transfer_params,
        )
        task = asyncio.create_task(engine.generate([decode_leg]))
        while len(llm.prompts) < 2:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        await llm.pause_generation(mode="abort")  # an abort-mode swap ends the request mid-decode
        engine._swaps += 1
        await llm.resume_generation()
        [decoded] = await task
        return answer, decoded

    answer, decoded = asyncio.run(run())
    assert (
        answer.kv_transfer_params["do_remote_prefill"] and answer.kv_transfer_params["remote_num_tokens"] == 3
    )
    assert llm.kv_params[0] == json.loads(DO_REMOTE_DECODE)
    assert llm.kv_params[1] == answer.kv_transfer_params  # the decode leg's first submission
    assert len(llm.kv_params) == 3 and llm.kv_params[2] is None  # the continuation recomputes
    [comp] = decoded.completions
    assert len(comp.token_ids) == 30 and comp.kv_versions == comp.token_versions
