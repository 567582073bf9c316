"""looprl's vLLM weight path against vLLM 0.33's own code, on CPU (no GPU, no vLLM engine).

Real vLLM here (tests/support/vllm_side.py loads the pinned wheel's Python files beside our
torch): the msgpack encoder/decoder of utility calls (vllm/v1/serial_utils.py, with msgspec),
the weight-transfer base class, config and factory (vllm/distributed/weight_transfer/,
vllm/config/weight_transfer.py), and AsyncLLM's method signatures read from its source.
Stand-ins: the modules listed in vllm_side.STUBS (none on the paths under test), and AsyncLLM
itself (tests/support/vllm_double.py), whose signatures must equal the real ones. What only a
GPU shows (vLLM's processes, CUDA IPC handles, generation across a swap) is in
tests/integration/inference_router/test_engine_vllm.py and tools/gpu_check.sh.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from bench.harness.synthetic_weights import random_state
from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.engine.vllm_engine import SwapError, VLLMEngine, init_info_of
from services.inference_router.engine.vllm_handoff import manifest_of
from services.kit.config.recipe import DeploymentSpec
from services.kit.rpc.errors import Unavailable
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, shard_state_dict
from services.weights.errors import ChecksumMismatch, InvalidWeights
from tests.support import vllm_side
from tests.support.vllm_double import RecordingAsyncLLM, async_llm_signatures, normalized

CONFIG = ModelConfig.tiny(vocab_size=96, max_position_embeddings=128)
TP2 = Layout(2, "fused", "bfloat16")


def _states(layout: Layout, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    full = random_state(CONFIG, seed=seed)
    return [shard_state_dict(full, CONFIG, layout, r) for r in range(layout.tp_size)]


def _same_types(a, b, where="value") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} became {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same_types(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_types(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _engine(llm, layout=TP2, pause_mode="keep") -> VLLMEngine:
    return VLLMEngine(llm, CONFIG, 128, 16, False, 0, (), layout=layout, pause_mode=pause_mode)


# ---------------------------------------------------------------- (a) serialization


def test_every_argument_survives_vllms_own_msgpack_round_trip_with_its_types():
    serial = vllm_side.load("vllm.v1.serial_utils")
    encoder, decoder = serial.MsgpackEncoder(), serial.MsgpackDecoder()  # the engine core's, untyped
    handoffs = [manifest_of(3, s, {"model.embed_tokens.weight": 48 * r}) for r, s in enumerate(_states(TP2))]
    try:
        payloads = {
            "init_info": init_info_of(DeploymentSpec(backend="vllm", tensor_parallel=2)),
            "update_info": [h.for_phase("verify") for h in handoffs],
        }
        assert any(p.get("row_start") == 48 for p in payloads["update_info"][1]["params"])
        assert all(p["hash64"] >= 0 for h in payloads["update_info"] for p in h["params"])
        for name, value in payloads.items():
            (_, _, _method, args) = decoder.decode(
                encoder.encode((0, 7, "collective_rpc", ("m", None, (), {name: value})))
            )
            _same_types(value, args[3][name], name)
        # pause_generation, reset_prefix_cache, set_weight_version
        for args in (("keep", False), (True, False), ("12",)):
            _same_types(list(args), decoder.decode(encoder.encode((0, 1, "u", args)))[3])
        # what the workers report back (a utility result, decoded typed as the client does)
        reports = [
            {"verified": 3, "loaded": -1, "error": ""},
            {"verified": -1, "loaded": -1, "error": "hash64"},
        ]
        back = serial.MsgpackDecoder(serial.UtilityResult).decode(
            encoder.encode(serial.UtilityResult(reports))
        )
        _same_types(reports, back.result, "reports")
    finally:
        for h in handoffs:
            h.close()


def test_the_round_trip_check_catches_what_vllm_does_not_keep():
    """The old engine's (name, tensor) pairs: tuples come back as lists, tensors are refused."""
    serial = vllm_side.load("vllm.v1.serial_utils")
    encoder, decoder = serial.MsgpackEncoder(), serial.MsgpackDecoder()
    with pytest.raises(AssertionError, match="tuple became list"):
        _same_types([("w", 1)], decoder.decode(encoder.encode([("w", 1)])))
    with pytest.raises(AssertionError, match="a tensor reached"):  # vllm_side's tensor_data stand-in
        encoder.encode([("w", torch.ones(4))])


# ---------------------------------------------------------------- (b) backend interface


def test_backend_satisfies_vllms_weight_transfer_engine_interface():
    base = vllm_side.load("vllm.distributed.weight_transfer.base")
    factory = vllm_side.load("vllm.distributed.weight_transfer.factory")
    from services.inference_router.engine import vllm_transfer

    cls = vllm_transfer.LooprlWeightTransferEngine
    assert issubclass(cls, base.WeightTransferEngine) and not inspect.isabstract(cls)
    abstract = {
        n for n, v in vars(base.WeightTransferEngine).items() if getattr(v, "__isabstractmethod__", False)
    }
    assert abstract == {
        "init_transfer_engine",
        "start_weight_update",
        "finish_weight_update",
        "receive_weights",
        "shutdown",
    }, f"vLLM's abstract interface changed: {sorted(abstract)}"
    for name in abstract | {"__init__"}:
        ours = [(p.name, p.kind) for p in inspect.signature(getattr(cls, name)).parameters.values()]
        theirs = [
            (p.name, p.kind)
            for p in inspect.signature(getattr(base.WeightTransferEngine, name)).parameters.values()
        ]
        assert ours == theirs, f"{name}: {ours} vs vLLM's {theirs}"
    assert issubclass(cls.init_info_cls, base.WeightTransferInitInfo)
    assert issubclass(cls.update_info_cls, base.WeightTransferUpdateInfo)
    register = inspect.signature(factory.WeightTransferEngineFactory.register_engine)
    assert list(register.parameters) == ["name", "module_path_or_cls", "class_name"]
    assert factory.WeightTransferEngineFactory._registry["looprl"]() is cls
    vllm_transfer.register()  # idempotent: a second import in the same worker must not raise


def test_each_worker_loads_its_own_rank_and_a_corrupt_version_touches_nothing():
    """Rank 1's copy of version 2 is corrupted in a tensor slice only rank 1 holds (its half of a
    row-parallel projection), so rank 0's own copy checks out: rank 0 must still load nothing,
    which holds only if every rank's verdict is read before any rank loads."""
    llm = RecordingAsyncLLM(CONFIG, TP2)
    engine = _engine(llm)
    import asyncio

    corrupted = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: split by input column

    async def run():
        await llm.init_weight_transfer_engine(
            SimpleNamespace(init_info=init_info_of(DeploymentSpec(backend="vllm", tensor_parallel=2)))
        )
        v1 = _states(TP2, seed=1)
        await engine.swap(1, v1)
        for rank in range(2):
            for name, t in llm.served(rank).items():
                assert torch.equal(t, v1[rank][name]), (rank, name)
        # corrupt one byte of rank 1's slice between the replica writing it and the worker reading it
        v2 = _states(TP2, seed=2)
        assert not torch.equal(v2[0][corrupted], v2[1][corrupted])  # each rank holds its own slice
        real, hit = manifest_of, []

        def corrupting(version, state, row_starts=None):
            h = real(version, state, row_starts)
            if version == 2 and state is v2[1]:
                [param] = [p for p in h.update_info["params"] if p["name"] == corrupted]
                h.segment.buf[param["offset"]] ^= 0xFF
                hit.append(param["name"])
            return h

        import services.inference_router.engine.vllm_engine as mod

        mod.manifest_of, before = corrupting, [llm.served(r) for r in range(2)]
        try:
            with pytest.raises(ChecksumMismatch, match=r"rank 1: .*hash64"):
                await engine.swap(2, v2)
        finally:
            mod.manifest_of = real
        assert hit == [corrupted]
        for rank in range(2):  # rank 0, whose own copy was intact, loaded nothing either
            assert all(torch.equal(llm.served(rank)[n], before[rank][n]) for n in before[rank]), rank
        assert engine.version == 1 and llm.weight_version == "1" and engine.status().ready
        assert llm.names()[-2:] == ["rpc:finish_weight_update", "resume_scheduler"]
        await engine.swap(2, v2)  # the retried version goes through
        assert engine.version == 2 and llm.weight_version == "2"

    asyncio.run(run())


def test_a_load_that_fails_on_one_rank_after_another_loaded_takes_the_engine_out_of_service():
    """Both ranks verified version 2, then rank 1's load raised while rank 0 loaded its shard:
    the workers now hold two versions. The engine must not resume on them as version 1."""
    import asyncio

    llm = RecordingAsyncLLM(CONFIG, TP2)
    engine = _engine(llm)

    async def run():
        await llm.init_weight_transfer_engine(
            SimpleNamespace(init_info=init_info_of(DeploymentSpec(backend="vllm", tensor_parallel=2)))
        )
        v1, v2 = _states(TP2, seed=1), _states(TP2, seed=2)
        await engine.swap(1, v1)
        llm.fail_update, llm.fail_rank = "load", 1
        llm.calls.clear()
        engine.pause()  # a request waiting at the engine's gate through the failed swap
        waiting = asyncio.create_task(engine.generate([EngineRequest([1, 2], SamplingParams(max_tokens=2))]))
        await asyncio.sleep(0.01)
        with pytest.raises(SwapError, match=r"version 2 failed while loading.*rank 1 failed"):
            await engine.swap(2, v2)
        with pytest.raises(Unavailable, match="out of service"):  # woken to fail, not left hanging
            await asyncio.wait_for(waiting, 5)
        # mixed weights on the workers: the reason the engine must stop
        assert all(torch.equal(llm.served(0)[n], t) for n, t in v2[0].items())
        assert all(torch.equal(llm.served(1)[n], t) for n, t in v1[1].items())
        status = engine.status()
        assert not status.ready and status.paused and "mixed weights" in status.extra["broken"]
        assert "pause_generation" in llm.names() and "resume_scheduler" not in llm.names()
        assert engine.version == 1 and llm.weight_version == "1"
        engine.resume()  # a user's resume does not reopen a broken engine
        assert engine.status().paused
        with pytest.raises(Unavailable, match="out of service"):
            async for _ in engine._run(EngineRequest([1, 2], SamplingParams(max_tokens=2))):
                pass

    asyncio.run(run())


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_prefix_cache_reset_vllm_cannot_do_takes_the_engine_out_of_service(mode):
    """vLLM 0.33 raises (rather than returns False) when even preempting the running requests
    cannot free the cache: the new weights are in, but KV from the old ones may be reused, so the
    engine must neither resume nor report itself ready."""
    import asyncio

    # keep: the one reset preempts and raises; abort: the plain reset says False, the fallback raises
    llm = RecordingAsyncLLM(CONFIG, TP2, reset_results=(False,) if mode == "keep" else (False, False))
    engine = _engine(llm, pause_mode=mode)

    async def run():
        await llm.init_weight_transfer_engine(
            SimpleNamespace(init_info=init_info_of(DeploymentSpec(backend="vllm", tensor_parallel=2)))
        )
        llm.calls.clear()
        with pytest.raises(SwapError, match="prefix cache could not be reset after loading version 3"):
            await engine.swap(3, _states(TP2, seed=3))

    asyncio.run(run())
    assert llm.names()[-1] == "reset_prefix_cache" and "resume_scheduler" not in llm.names()
    status = engine.status()
    assert not status.ready and status.paused and "stale KV" in status.extra["broken"]


def test_a_manifest_that_does_not_fit_the_worker_is_refused_before_loading():
    llm = RecordingAsyncLLM(CONFIG, TP2)
    worker = llm.workers[0]
    worker.init_transfer_engine(
        worker.parse_init_info(init_info_of(DeploymentSpec(backend="vllm", tensor_parallel=2)))
    )
    wrong = _states(Layout(2, "fused", "float32"))[0]
    handoff = manifest_of(1, wrong)
    try:
        worker.start_weight_update()
        worker.update_weights(handoff.for_phase("verify"))  # reported, not raised (see vllm_transfer)
        report = worker.report()
        assert report["verified"] == -1 and "params[0].dtype" in report["error"]
        with pytest.raises(InvalidWeights, match="must be verified before it is loaded"):
            worker.update_weights(handoff.for_phase("load"))
        assert all(not p.any() for p in worker.model.parameters())  # nothing written
        with pytest.raises(InvalidWeights, match="tensor_parallel"):
            worker.init_transfer_engine(
                worker.parse_init_info({"tensor_parallel": 1, "naming": "fused", "dtype": "bfloat16"})
            )
        with pytest.raises(ValueError, match="Invalid init_info"):  # vLLM's own parse_init_info
            worker.parse_init_info({"tp": 2})
    finally:
        handoff.close()


# ---------------------------------------------------------------- (c) swap sequence


def test_recording_double_has_async_llms_exact_signatures():
    real = async_llm_signatures()
    methods = [n for n, v in vars(RecordingAsyncLLM).items() if callable(v) and not n.startswith("_")]
    checked = [n for n in methods if n in real]
    assert set(methods) - set(checked) == {"names", "served"}, "every AsyncLLM stand-in must exist in vLLM"
    for name in checked:
        assert normalized(getattr(RecordingAsyncLLM, name)) == real[name], (
            f"AsyncLLM.{name} differs from vLLM 0.33"
        )


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_swap_runs_vllms_sequence_in_order_and_checks_the_prefix_cache_reset(mode):
    import asyncio

    # abort: the plain reset may find KV still held (False) and falls back to preempting; keep
    # preempts at once (vLLM raises rather than return False there, see the double)
    llm = RecordingAsyncLLM(CONFIG, TP2, reset_results=(False, True) if mode == "abort" else ())
    engine = _engine(llm, pause_mode=mode)

    async def run():
        await llm.init_weight_transfer_engine(
            SimpleNamespace(init_info=init_info_of(DeploymentSpec(backend="vllm", tensor_parallel=2)))
        )
        llm.calls.clear()
        await engine.swap(5, _states(TP2, seed=5))

    asyncio.run(run())
    assert llm.names() == [
        "pause_generation",
        "rpc:start_weight_update",
        "rpc:update_weights",
        "rpc:looprl_weight_status",
        "rpc:update_weights",
        "rpc:finish_weight_update",
        "set_weight_version",
        "reset_prefix_cache",
        *(["reset_prefix_cache"] if mode == "abort" else []),
        "resume_scheduler",
    ]
    calls = dict(llm.calls[:1])
    assert calls["pause_generation"] == [mode, False]
    phases = [
        args[3]["update_info"][r]["phase"]
        for m, args in llm.calls
        if m == "collective_rpc" and args[0] == "update_weights"
        for r in range(2)
    ]
    assert phases == ["verify", "verify", "load", "load"]
    resets = [args for m, args in llm.calls if m == "reset_prefix_cache"]
    assert resets[0][0] is (mode == "keep") and resets[-1][0] is True
    assert engine.version == 5 and llm.weight_version == "5" and engine.status().ready


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_tokens_keep_the_version_that_sampled_them_across_a_swap_mid_request(mode, monkeypatch):
    """A request in flight through a swap: its tokens before it carry version 0, after it 1 (and
    the double's log-probs prove which weights produced each); an abort-mode swap continues the
    aborted completion as a new request over the prompt plus what it already had."""
    import asyncio

    from services.inference_router.engine import vllm_engine
    from services.inference_router.engine.base import EngineRequest, SamplingParams

    # Seams for vLLM's SamplingParams / TokensPrompt, which cannot import beside our torch.
    monkeypatch.setattr(vllm_engine, "vllm_sampling_params", lambda **kw: SimpleNamespace(**kw))
    monkeypatch.setattr(vllm_engine, "tokens_prompt", lambda ids: {"prompt_token_ids": ids})
    llm = RecordingAsyncLLM(CONFIG, TP2)
    engine = _engine(llm, pause_mode=mode)

    async def run():
        await llm.init_weight_transfer_engine(
            SimpleNamespace(init_info=init_info_of(DeploymentSpec(backend="vllm", tensor_parallel=2)))
        )
        request = EngineRequest([3, 4, 5], SamplingParams(temperature=1.0, max_tokens=30))
        task = asyncio.create_task(engine.generate([request]))
        while not llm.prompts or engine.status().queued_requests == 0:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        await engine.swap(1, _states(TP2, seed=1))
        [result] = await task
        return result.completions[0]

    comp = asyncio.run(run())
    assert len(comp.token_ids) == 30 and comp.finish_reason == "length"
    switch = comp.token_versions.index(1)
    assert switch > 0 and comp.token_versions == [0] * switch + [1] * (30 - switch)
    assert comp.logprobs == [-1.0] * switch + [-2.0] * (
        30 - switch
    )  # labelled by the weights that sampled them
    assert comp.weight_version == 0
    if mode == "abort":
        assert llm.prompts == [[3, 4, 5], [3, 4, 5, *comp.token_ids[:switch]]]
    else:
        assert llm.prompts == [[3, 4, 5]]


def test_a_request_refused_by_an_abort_pause_it_raced_with_is_submitted_again(monkeypatch):
    import asyncio

    from services.inference_router.engine import vllm_engine
    from services.inference_router.engine.base import EngineRequest, SamplingParams

    monkeypatch.setattr(vllm_engine, "vllm_sampling_params", lambda **kw: SimpleNamespace(**kw))
    monkeypatch.setattr(vllm_engine, "tokens_prompt", lambda ids: {"prompt_token_ids": ids})
    llm = RecordingAsyncLLM(CONFIG, TP2)
    engine = _engine(llm, pause_mode="abort")

    async def run():
        await llm.pause_generation(mode="abort")  # vLLM paused; the engine's own gate still open
        task = asyncio.create_task(engine.generate([EngineRequest([1, 2], SamplingParams(max_tokens=5))]))
        await asyncio.sleep(0.05)
        assert not task.done() and len(llm.prompts) > 1  # refused, and tried again
        await llm.resume_generation()
        [result] = await task
        return result.completions[0]

    comp = asyncio.run(run())
    assert len(comp.token_ids) == 5 and comp.finish_reason == "length"


def test_engine_arguments_are_fields_of_vllms_engine_args():
    """Every keyword the engine passes AsyncEngineArgs is a field of vLLM 0.33's EngineArgs (read from
    its source: arg_utils imports the engine graph), and the backend name is a plain string there."""
    import ast

    from services.inference_router.engine.vllm_args import engine_args

    tree = ast.parse(vllm_side.source("vllm/engine/arg_utils.py"))
    fields = {
        node.target.id
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name in ("EngineArgs", "AsyncEngineArgs")
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    spec = DeploymentSpec(backend="vllm", tensor_parallel=2, max_model_len=256)
    ours = engine_args("/m", "dummy", spec)
    assert set(ours) <= fields, sorted(set(ours) - fields)
    # The values that decide how vLLM runs, with a recipe's defaults: bf16 (vLLM would otherwise
    # take the checkpoint's, our dummy config's float32), vLLM's own memory share for 0, graphs on.
    # test_vllm_deployment.py shows set values reaching AsyncEngineArgs through VLLMEngine.create.
    assert {k: ours[k] for k in ("dtype", "tensor_parallel_size", "max_model_len", "enforce_eager")} == {
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "max_model_len": 256,
        "enforce_eager": False,
    }
    assert ours["gpu_memory_utilization"] == 0.85 and ours["logprobs_mode"] == "processed_logprobs"
    wt_config = vllm_side.load("vllm.config.weight_transfer")
    assert wt_config.WeightTransferConfig(**ours["weight_transfer_config"]).backend == "looprl"
