"""The project's torch paths on a CUDA GPU, checked and measured; the cost-model file made from them.

    python -m tools.gpu_torch_check [--cpu] [--out DIR] [--budget-s 420] [--only SECTION,...]

Needs only what a bare CUDA image holds: torch (with numpy), xxhash, grpcio and protobuf; no Ray, no
vLLM, no pydantic, no OpenTelemetry (the model, the engine, the training step and the weight
transport import none of them). Sections, each reported as passed, failed or skipped with why:

1. `tests`: every test module marked `gpu` that imports neither Ray nor vLLM, through pytest when it
   is installed (carry pytest, pluggy, iniconfig and pytest-asyncio as wheels otherwise);
2. `parity`: the model's forward and log-probs and one training step (services/trainer/step.py, AdamW)
   on the device against float32 on the CPU, in float32 and bfloat16 (TF32 off for float32);
3. `engine`: the project's continuous-batching engine (services/inference_router/engine) on the
   device for the 10M model (configs/math_10m_grpo.toml's shape) and a ~0.5B Qwen2 built from a
   config (Qwen2.5-0.5B's shape, random weights): prefill and decode tokens/s at batch 1-256 and
   prompts of 64-4,096 tokens (sim/engine_costs.py), points past the time budget skipped and listed;
4. `train`: the training step's tokens/s for both models;
5. `transport`: the `cuda_ipc` weight transport (services/weight_sync/transport/gpu.py) from this
   process to a receiver in another process on the same GPU: stage, verify (every slice's checksum),
   commit, then the receiver's weights compared with the sender's; GB/s against a device-to-device
   copy of the same bytes. On the CPU the same two-process harness runs the gRPC transport;
6. a cost-model file per model (services/decisions/cost_model.py's format, naming the GPU) that
   `bench/pd_disaggregation.py --cost-model FILE` and the tuner read beside the roofline defaults.

Without CUDA (or with --cpu) it runs every section it can on the CPU with small sizes, so the
harness itself is checked here. Everything printed also lands in OUT (default reports/gpu-torch-check):
summary.json, summary.txt and cost_<model>.json. Exit 0 when no section failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

SECTIONS = ("tests", "parity", "engine", "train", "transport")


def model_configs() -> dict[str, Any]:
    """The models measured: the 10M recipe's shape and Qwen2.5-0.5B's (positions for 4k prompts)."""
    from services.modeling.config import ModelConfig

    return {
        "qwen2-10m": ModelConfig.tiny(
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            max_position_embeddings=8192,
        ),
        "qwen2.5-0.5b": ModelConfig(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
        ),
    }


class Report:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.sections: dict[str, dict[str, Any]] = {}
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        self.say(f"== {name}")
        started = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # a failed section is reported; the others still run
            result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            self.say(f"   FAILED: {result['error']}")
        result.setdefault("status", "passed")
        result["seconds"] = round(time.perf_counter() - started, 2)
        self.sections[name] = result
        self.say(
            f"   {result['status']} in {result['seconds']:.1f}s"
            + (f": {result['why']}" if "why" in result else "")
        )

    def write(self, env: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "summary.json").write_text(
            json.dumps({"environment": env, **self.sections}, indent=1) + "\n"
        )
        (self.out / "summary.txt").write_text("\n".join(self.lines) + "\n")


def skipped(why: str) -> dict[str, Any]:
    return {"status": "skipped", "why": why}


# ---- 1. gpu-marked tests ----------------------------------------------------------------------


def gpu_test_modules() -> list[Path]:
    """Test modules that mark a test `gpu` and import neither Ray nor vLLM."""
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text()
        needs = re.search(r"^\s*(import|from)\s+(ray\b|\S*vllm)", text, re.M)  # lazy imports too
        if "pytest.mark.gpu" in text and not needs:
            found.append(path)
    return found


def section_tests(device: str) -> dict[str, Any]:
    modules = gpu_test_modules()
    if device != "cuda":
        return skipped(f"needs CUDA ({len(modules)} modules: {', '.join(m.name for m in modules)})")
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {
            "status": "failed",
            "why": "pytest is not installed: carry pytest, pluggy, iniconfig, pytest-asyncio",
        }
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        *map(str, modules),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    tail = proc.stdout.strip().splitlines()[-15:]
    status = "passed" if proc.returncode == 0 and "skipped" not in (tail[-1] if tail else "") else "failed"
    return {"status": status, "modules": [str(m.relative_to(ROOT)) for m in modules], "output": tail}


# ---- 2. parity ------------------------------------------------------------------------------------


def _packed(config: Any, lengths: list[int], seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return ids, positions, cu


def _micro_batch(config: Any, lengths: list[int], prompt: int, seed: int):
    import torch

    from services.trainer.batch import PackedMicroBatch

    ids, positions, cu = _packed(config, lengths, seed)
    mask = torch.zeros(len(ids))
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        mask[start + prompt : end] = 1.0
    g = torch.Generator().manual_seed(seed + 1)
    advantages = torch.randn(len(ids), generator=g) * mask
    behaviour = -torch.rand(len(ids), generator=g) * mask
    return PackedMicroBatch(
        step=0,
        input_ids=ids,
        position_ids=positions,
        cu_seqlens=cu,
        loss_mask=mask,
        advantages=advantages,
        behaviour_logprobs=behaviour,
        versions=torch.zeros(len(ids), dtype=torch.long),
        global_loss_tokens=int(mask.sum()),
        global_sequences=len(lengths),
    )


def _loss_settings() -> Any:
    """The recipe's default [algorithm] section; its plain values when pydantic is not installed."""
    from services.trainer.step import StepSettings

    try:
        from services.kit.recipe import AlgorithmSection

        loss: Any = AlgorithmSection()
    except ImportError:
        from types import SimpleNamespace

        loss = SimpleNamespace(
            advantage="grpo",
            filter_equal_rewards=False,
            loss_aggregation="token-mean",
            clip_low=0.2,
            clip_high=0.28,
            tis_cap=2.0,
            kl_coef=0.0,
            entropy_coef=0.0,
            group_timeout_seconds=120.0,
        )
    return StepSettings(loss=loss)


def _optimizer(model: Any, lr: float) -> tuple[Any, Any]:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def _train_once(
    model: Any, mb: Any, lr: float = 1e-3, optimizer: tuple[Any, Any] | None = None
) -> tuple[float, float]:
    """One step of the trainer's own code (accumulate, clip, AdamW); (loss, grad norm)."""
    from services.trainer.step import accumulate, apply_gradients

    opt, scheduler = optimizer or _optimizer(model, lr)
    sums = accumulate(model, [mb], _loss_settings(), trainer_version=0)
    norm, _, _ = apply_gradients(model, opt, scheduler, grad_clip=1.0)
    return float(sums.metrics.sums["loss"]), norm


def section_parity(device: str, cpu_mode: bool) -> dict[str, Any]:
    import torch

    from services.modeling.logprobs import token_logprobs
    from services.modeling.qwen2 import Qwen2ForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    configs = model_configs()
    names = ["qwen2-10m"] if cpu_mode else list(configs)
    results: dict[str, Any] = {}
    bounds = {"float32": 2e-3, "bfloat16": 0.15}  # max |log-prob difference| allowed, nats
    failed = []
    for name in names:
        config = configs[name]
        ref = Qwen2ForCausalLM(config, seed=None)
        ref.init_weights(0, std=0.02)
        ids, positions, cu = _packed(config, [17, 64, 130], seed=1)
        with torch.no_grad():
            ref_logits = ref(ids, positions, cu)
            ref_lp = token_logprobs(ref_logits, ids, cu)
        train_ref = None
        if name == "qwen2-10m":
            mb = _micro_batch(config, [48, 80, 96], prompt=32, seed=2)
            train_model = Qwen2ForCausalLM(config, seed=None)
            train_model.load_state_dict(ref.state_dict())
            train_ref = (
                _train_once(train_model, mb),
                {k: v.detach().clone() for k, v in train_model.state_dict().items()},
            )
        for dtype_name in ("float32", "bfloat16"):
            dtype = getattr(torch, dtype_name)
            model = Qwen2ForCausalLM(config, seed=None)
            model.load_state_dict(ref.state_dict())
            model = model.to(device=device, dtype=dtype)
            with torch.no_grad():
                logits = model(ids.to(device), positions.to(device), cu.to(device)).float().cpu()
                lp = token_logprobs(logits, ids, cu)
            row = {
                "logits_max_abs_diff": float((logits - ref_logits).abs().max()),
                "logprob_max_abs_diff": float((lp - ref_lp).abs().max()),
                "logprob_mean_abs_diff": float((lp - ref_lp).abs().mean()),
            }
            if train_ref is not None:
                (ref_loss, ref_norm), ref_weights = train_ref
                (loss, norm) = _train_once(model, mb.to(device))
                moved = max(
                    float((v.float().cpu() - ref_weights[k]).abs().max())
                    for k, v in model.state_dict().items()
                )
                row.update(
                    loss=loss,
                    loss_cpu=ref_loss,
                    grad_norm=norm,
                    grad_norm_cpu=ref_norm,
                    weights_max_abs_diff=moved,
                )
            ok = row["logprob_max_abs_diff"] <= bounds[dtype_name]
            row["ok"] = ok
            if not ok:
                failed.append(f"{name} {dtype_name}")
            results[f"{name}/{dtype_name}"] = row
            print(
                f"   {name:<13} {dtype_name:<9} "
                + ", ".join(f"{k} {v:.3g}" for k, v in row.items() if k != "ok")
            )
    out: dict[str, Any] = {"device": device, "results": results, "bounds_logprob_max_abs_diff": bounds}
    if failed:
        out.update(status="failed", why=f"log-probs off beyond the bound: {', '.join(failed)}")
    return out


# ---- 3. the engine, and 4. the training step ----------------------------------------------------------


def _synchronize(device: str) -> Callable[[], None] | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.synchronize


def section_engine(device: str, cpu_mode: bool, deadline: float, gpu: str) -> dict[str, Any]:
    from services.decisions.cost_model import MeasuredCost
    from sim.engine_costs import cpu_engine_factory, measure_engine

    dtype = "bfloat16" if device == "cuda" else "float32"
    if cpu_mode:
        grids = {"qwen2-10m": ((1, 4, 16), (16, 64, 256), 8)}
    else:
        grids = {
            "qwen2-10m": ((1, 8, 32, 128, 256), (64, 512, 4096), 16),
            "qwen2.5-0.5b": ((1, 8, 32, 128, 256), (64, 512, 4096), 16),
        }
    configs, results = model_configs(), {}
    for i, (name, (batches, lengths, steps)) in enumerate(grids.items()):
        config = configs[name]
        # The time left is shared out: each model may use its share of what remains.
        share = deadline - (deadline - time.perf_counter()) * (len(grids) - i - 1) / (len(grids) - i)
        data = asyncio.run(
            measure_engine(
                cpu_engine_factory(config, device=device, dtype=dtype),
                config.vocab_size,
                batches=batches,
                prompt_lengths=lengths,
                decode_steps=steps,
                repeat=2,
                deadline=share,
                synchronize=_synchronize(device),
                max_prefill_tokens=0 if cpu_mode else 1 << 16,  # a 256 x 4k batch in 16 prefill steps
                log=lambda line: print("   " + line, flush=True),
            )
        )
        data.update(
            device=gpu,
            device_kind="cuda" if device == "cuda" else "cpu",
            dtype=dtype,
            model={"name": name, "parameters": _parameters(config), **config.to_dict()},
            created_by="tools/gpu_torch_check.py",
        )
        MeasuredCost.from_data(data)  # the file must read back before it is written
        results[name] = data
    return {"cost_models": results}


def _parameters(config: Any) -> int:
    from services.decisions.cost_model import ModelShape

    return int(ModelShape.from_hf_config(config.to_hf_dict(), config.model_type, 2).parameters)


def section_train(device: str, cpu_mode: bool) -> dict[str, Any]:
    import torch

    from services.modeling.qwen2 import Qwen2ForCausalLM

    configs = model_configs()
    shapes = (
        {"qwen2-10m": ([64] * 4, 16)}
        if cpu_mode
        else {"qwen2-10m": ([1024] * 8, 256), "qwen2.5-0.5b": ([1024] * 8, 256)}
    )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    results = {}
    for name, (lengths, prompt) in shapes.items():
        model = Qwen2ForCausalLM(configs[name], seed=None)
        model.init_weights(0, std=0.02)
        model = model.to(device=device, dtype=dtype)
        mb = _micro_batch(configs[name], lengths, prompt, seed=3).to(device)
        sync = _synchronize(device) or (lambda: None)
        optimizer = _optimizer(model, 1e-6)
        _train_once(model, mb, optimizer=optimizer)  # warm-up (kernels, allocator, AdamW state)
        sync()
        times = []
        for _ in range(3):
            started = time.perf_counter()
            _train_once(model, mb, optimizer=optimizer)
            sync()
            times.append(time.perf_counter() - started)
        tokens = sum(lengths)
        best = min(times)
        results[name] = {
            "tokens": tokens,
            "tokens_per_s": tokens / best,
            "seconds": best,
            "dtype": str(dtype),
        }
        print(f"   {name:<13} {tokens} tokens/step: {tokens / best:,.0f} tokens/s ({best * 1e3:.1f} ms)")
        del model
    return {"train": results}


# ---- 5. the weight transport between two processes -------------------------------------------------


def _digests(state: dict[str, Any]) -> dict[str, str]:
    from services.weights.checksum import hash64

    return {
        k: format(
            hash64(v.detach().contiguous().cpu().view(-1).view(__import__("torch").uint8).numpy().tobytes()),
            "016x",
        )
        for k, v in sorted(state.items())
    }


def receiver_main(config_json: str, device: str) -> None:
    """The receiving process: a replica rank that holds weights (services/weights), serving
    StageWeights/CommitWeights; prints its address, then each committed version's digests on request."""
    from services.modeling.config import ModelConfig
    from services.modeling.layouts import Layout, rank_params
    from services.weights import WeightOnlyEngine, WeightStager, serve_engine

    config = ModelConfig.from_dict(json.loads(config_json))

    async def main() -> None:
        engine = WeightOnlyEngine(
            WeightStager(rank_params(config, Layout(1, "hf"), 0), rank=0, device=device)
        )
        server, address = await serve_engine(engine)
        print(f"ADDRESS {address}", flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            print(
                "DIGESTS " + json.dumps({"version": engine.version, "digests": _digests(engine.weights)}),
                flush=True,
            )
        await server.stop(None)

    asyncio.run(main())


def _transport(device: str) -> Any:
    """The transport under test, talking over a plain channel when the tracing interceptors cannot be
    imported (a bare CUDA image has no OpenTelemetry)."""
    from services.kit import tls
    from services.weight_sync.transport.gpu import CudaIpcTransport
    from services.weight_sync.transport.grpc_stream import GrpcTransport

    base = CudaIpcTransport if device == "cuda" else GrpcTransport

    class Transport(base):  # type: ignore[misc, valid-type]
        def channel(self, address: str) -> Any:
            try:
                return super().channel(address)
            except ImportError:
                ch = self._channels.get(address)
                if ch is None:
                    ch = self._channels[address] = tls.aio_channel(
                        address, tls.message_limits(self.max_message_bytes)
                    )
                return ch

    return Transport(device) if device == "cuda" else Transport()


def section_transport(device: str, cpu_mode: bool) -> dict[str, Any]:
    from services.kit import tls
    from services.modeling.layouts import Layout
    from services.modeling.qwen2 import Qwen2ForCausalLM
    from services.trainer.shards import push_requests
    from services.weight_sync.plan import build_deployment_plan
    from services.weight_sync.planned_bucket import PlannedBucket
    from services.weight_sync.transport import Delivery, Endpoint
    from services.weight_sync.versions import VersionStore

    tls.adopt({"insecure": True})  # this check's own loopback channel to the receiver it starts
    name = "qwen2-10m" if cpu_mode else "qwen2.5-0.5b"
    config = model_configs()[name]
    model = Qwen2ForCausalLM(config, seed=None)
    model.init_weights(0, std=0.02)
    store = VersionStore(shm=False)
    for req in push_requests(model, version=0, rank=0, world_size=1):
        buf = store.buffer_for(req)
        for i, chunk in enumerate(req.shards):
            buf.add_chunk(0, chunk, i)
    buf.ranks_done.add(0)
    plan = build_deployment_plan(buf.layout(), config, Layout(1, "hf"), 64 << 20)
    (rank_plan,) = plan.ranks
    # A receiver on loopback, started by this check alone: no certificates to check it against.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "LOOPRL_INSECURE_PLAINTEXT": "true", "PYTHONPATH": path}
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tools.gpu_torch_check",
            "--receiver",
            json.dumps(config.to_dict()),
            "--device",
            device,
        ],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        if not line.startswith("ADDRESS "):
            raise RuntimeError(f"the receiver did not start: {line!r}")
        endpoint = Endpoint(line.split()[1], 0, "check")

        async def deliver() -> tuple[float, int, int]:
            transport = _transport(device)
            try:
                buckets = [PlannedBucket(spec, rank_plan.dtype, buf.chunks) for spec in rank_plan.buckets]
                started = time.perf_counter()
                (result,) = (await transport.stage(Delivery(0, buckets), [endpoint])).values()
                seconds = time.perf_counter() - started
                if result.error is not None or not result.complete:
                    raise RuntimeError(f"staging failed: {result.error}")
                committed = await transport.commit(endpoint, 0)
                return seconds, committed, sum(b.nbytes for b in buckets)
            finally:
                await transport.close()

        seconds, committed, nbytes = asyncio.run(deliver())
        child.stdin.write("digests\n")
        child.stdin.flush()
        reply = json.loads(child.stdout.readline().split(" ", 1)[1])
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    # The receiver holds its layout's parameters (a tied lm_head is embed_tokens, never sent twice).
    want = _digests(model.state_dict())
    got = reply["digests"]
    equal = [k for k, v in got.items() if want.get(k) == v]
    copy_gbps = _device_copy_gb_per_s(nbytes, device)
    gbps = nbytes / seconds / 1e9
    result = {
        "model": name,
        "transport": "cuda_ipc" if device == "cuda" else "grpc",
        "bytes": nbytes,
        "stage_seconds": seconds,
        "gb_per_s": gbps,
        "device_copy_gb_per_s": copy_gbps,
        "fraction_of_device_copy": gbps / copy_gbps,
        "committed_version": committed,
        "tensors_equal": len(equal),
        "tensors": len(got),
    }
    print(
        f"   {result['transport']}: {nbytes / 1e6:.1f} MB staged in {seconds:.3f}s = {gbps:.2f} GB/s, "
        f"{gbps / copy_gbps:.1%} of a {'device' if device == 'cuda' else 'memory'} copy ({copy_gbps:.1f} GB/s); "
        f"{len(equal)}/{len(got)} tensors equal after commit"
    )
    if committed != 0 or not got or len(equal) != len(got):
        result.update(status="failed", why="the receiver does not hold exactly the sent weights")
    return result


def _device_copy_gb_per_s(nbytes: int, device: str) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync = _synchronize(device) or (lambda: None)
    sync()
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


# ---- the run ----------------------------------------------------------------------------------------


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def environment(device: str) -> dict[str, Any]:
    import torch

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "",
        "absent": [m for m in ("ray", "vllm", "pydantic", "opentelemetry", "pytest") if not _installed(m)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the CPU parts only, at small sizes")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "reports" / "gpu-torch-check", help="where results go"
    )
    parser.add_argument("--budget-s", type=float, default=420.0, help="seconds the measurements may take")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run ({', '.join(SECTIONS)})")
    parser.add_argument("--receiver", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.receiver:
        receiver_main(args.receiver, args.device)
        return 0
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)} (known: {', '.join(SECTIONS)})")
    import torch

    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    cpu_mode = device == "cpu"
    env = environment(device)
    from sim.engine_costs import cpu_name

    gpu = env["gpu"] or cpu_name()
    report = Report(args.out)
    report.say(
        f"torch {env['torch']} cuda {env['cuda'] or '-'} on {gpu}; not installed: {', '.join(env['absent']) or 'none'}"
    )
    only = args.only.split(",")
    deadline = started + args.budget_s
    sections: dict[str, Callable[[], dict[str, Any]]] = {
        "tests": lambda: section_tests(device),
        "parity": lambda: section_parity(device, cpu_mode),
        "train": lambda: section_train(device, cpu_mode),
        "transport": lambda: section_transport(device, cpu_mode),
        # Last: it takes what is left of the budget.
        "engine": lambda: section_engine(device, cpu_mode, deadline, gpu),
    }
    for name, fn in sections.items():
        if name in only:
            report.run(name, fn)
    files = write_cost_models(report.sections, args.out)
    for path in files:
        report.say(f"cost model: {path}")
    report.say(f"done in {time.perf_counter() - started:.0f}s")
    report.write(env)
    return 1 if any(r["status"] == "failed" for r in report.sections.values()) else 0


def write_cost_models(sections: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    """One cost-model file per measured model, with its training and transfer figures beside."""
    from services.decisions.cost_model import write_cost_file

    engine = sections.get("engine", {})
    train = sections.get("train", {}).get("train", {})
    transport = sections.get("transport", {})
    paths = []
    for name, data in engine.get("cost_models", {}).items():
        if name in train:
            data["train"] = [{"tokens": train[name]["tokens"], "tokens_per_s": train[name]["tokens_per_s"]}]
        if transport.get("status") == "passed":
            key = f"{transport['transport']}_gb_per_s"
            data["transport"] = {
                key: transport["gb_per_s"],
                "device_copy_gb_per_s": transport["device_copy_gb_per_s"],
                # KV moves between a prefill and a decode worker of one host the way weights do.
                "kv_gb_per_s": transport["gb_per_s"],
            }
        paths.append(write_cost_file(out / f"cost_{name}.json", data))
    return paths


if __name__ == "__main__":
    sys.exit(main())
