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

from tools.gpu_torch_steps import model_configs, section_parity, section_train, synchronize  # noqa: E402
from tools.gpu_weight_transport import section_transport  # noqa: E402

SECTIONS = ("tests", "parity", "engine", "train", "transport")


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
                synchronize=synchronize(device),
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
    args = parser.parse_args(argv)
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
