"""The sizing and the verdict of tools/gpu_check.sh's run of configs/gpu_vllm_gsm8k.toml, as pure
functions (tests/unit/deploy/test_gpu_check.py checks them without GPUs).

Sizing: the run needs the trainer (one rank) and two vLLM deployments of one replica each, tp=1
and tp=2 where the GPUs allow it, else two tp=1. Ray counts GPUs logically: a replica asks for
`DeploymentSpec.gpus_per_replica` (tp whole GPUs, or its memory share when tp=1 with gpu_memory_utilization
set), a trainer rank for `num_gpus_per_rank`. A request Ray cannot place waits forever, so every
size below is one whose requests fit the machine whatever order Ray sees them in (whole-GPU
requests take free GPUs, fractional ones the best-fitting GPU, as Ray's resource_instance_set.cc
allocates them), and where processes share a GPU their memory shares add up to at most 1:

  1 GPU   trainer 0.3, both tp=1 replicas 0.35 each: all three on the one GPU
  2 GPUs  trainer 1, both tp=1 replicas 0.45 each, sharing the other GPU
  3 GPUs  trainer 0.5 and the tp=1 replica 0.45 sharing one GPU, the tp=2 replica on the other two
  4+      trainer 1, tp=1 replica 1, tp=2 replica 2

Verdict: every deployment must have committed every version 1..steps (weight-sync logs
"deployment X now serves version N (...)" once per commit).

    python -m tools.gpu_check_plan recipe GPUS STEPS OUT.toml   # the sized recipe
    python -m tools.gpu_check_plan verify STEPS RECIPE LOG...   # exit 1 naming missing versions
"""

from __future__ import annotations

import itertools
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "gpu_vllm_gsm8k.toml"
COMMITTED = re.compile(r"deployment (\S+) now serves version (\d+) \(")


def sizes(gpus: int) -> tuple[float, list[tuple[int, float]]]:
    """(the trainer rank's GPUs, [(tensor_parallel, gpu_memory_utilization or 0 for vLLM's default)]
    of the two deployments) for a machine with `gpus` GPUs."""
    if gpus < 1:
        raise ValueError(f"gpus: at least 1 needed, got {gpus}")
    if gpus == 1:
        return 0.3, [(1, 0.35), (1, 0.35)]
    if gpus == 2:
        return 1.0, [(1, 0.45), (1, 0.45)]
    if gpus == 3:
        return 0.5, [(1, 0.45), (2, 0.0)]
    return 1.0, [(1, 0.0), (2, 0.0)]


def sized_recipe(recipe: dict[str, Any], gpus: int, steps: int) -> dict[str, Any]:
    """The GPU recipe cut to `steps` small steps on this machine's GPUs (a preset architecture when
    the recipe's checkpoint is not here)."""
    r = {k: (dict(v) if isinstance(v, dict) else [dict(d) for d in v]) for k, v in recipe.items()}
    r["run"]["steps"] = steps
    if not Path(r["model"]["path"]).is_dir():
        r["model"] = {"path": "", "preset": "small-qwen2", "tokenizer": "char", "dtype": "bfloat16"}
    r["environment"]["config"] = dict(r["environment"]["config"])
    r["environment"]["config"]["dataset"] = str(ROOT / "configs" / "data" / "gsm8k_sample.jsonl")
    r["sampling"]["max_tokens"] = 256
    r["batch"].update(rollouts_per_step=64, group_size=8, max_tokens_per_microbatch=8192)
    trainer_gpus, deployments = sizes(gpus)
    r["trainer"].update(world_size=1, checkpoint_every=0, num_gpus_per_rank=trainer_gpus)
    for d, (tp, memory) in zip(r["deployments"], deployments, strict=True):
        d.update(tensor_parallel=tp, replicas=1, max_model_len=1024, model_path=r["model"]["path"])
        d.pop("gpu_memory_utilization", None)
        if memory:
            d["gpu_memory_utilization"] = memory
    r["deployments"][1]["min_output_tokens"] = 0
    return r


def ray_gpu_requests(recipe: Any) -> list[float]:
    """Every GPU request the parsed recipe makes of Ray, computed by the functions that make them
    (the trainer's rank bundles, each replica's actor options)."""
    from services.trainer.ranks import RankGroup

    t = recipe.trainer
    bundle = RankGroup(t.world_size, num_gpus_per_rank=t.num_gpus_per_rank).bundle()
    out = [bundle.get("GPU", 0.0)] * t.world_size
    for spec in recipe.deployments:
        out += [spec.gpus_per_replica] * spec.replicas
    return [g for g in out if g]


def place(requests: list[float], gpus: int) -> list[float] | None:
    """What is left of each GPU after Ray places `requests` in this order, or None when one cannot
    be placed: a whole number takes that many free GPUs, a fraction the GPU it fits best."""
    free = [1.0] * gpus
    for want in requests:
        if want >= 1:
            idle = [i for i, f in enumerate(free) if f >= 1 - 1e-9][: int(want)]
            if len(idle) < want:
                return None
            for i in idle:
                free[i] = 0.0
        else:
            fits = [i for i, f in enumerate(free) if f >= want - 1e-9]
            if not fits:
                return None
            best = min(fits, key=lambda i: free[i])
            free[best] -= want
    return free


def fits_in_any_order(requests: list[float], gpus: int) -> bool:
    return all(place(list(order), gpus) is not None for order in itertools.permutations(requests))


def missing_versions(log_text: str, deployments: list[str], steps: int) -> dict[str, list[int]]:
    """Per deployment, the versions 1..steps weight-sync did not log as committed."""
    committed: dict[str, set[int]] = {d: set() for d in deployments}
    for name, version in COMMITTED.findall(log_text):
        committed.setdefault(name, set()).add(int(version))
    return {
        d: missing
        for d in deployments
        if (missing := [v for v in range(1, steps + 1) if v not in committed[d]])
    }


def to_toml(recipe: dict[str, Any]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines = []
    for section, body in recipe.items():
        if section == "deployments":
            continue
        lines.append(f"[{section}]")
        lines += [f"{k} = {value(v)}" for k, v in body.items()]
    for d in recipe.get("deployments", []):
        lines.append("[[deployments]]")
        lines += [f"{k} = {value(v)}" for k, v in d.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "recipe":
        gpus, steps, out = int(args[0]), int(args[1]), Path(args[2])
        r = sized_recipe(tomllib.loads(RECIPE.read_text()), gpus, steps)
        out.write_text(to_toml(r))
        trainer_gpus, _ = sizes(gpus)
        print(
            f"recipe: {out}; Ray GPUs: trainer {trainer_gpus}, deployments "
            + ", ".join(
                f"{d['name']} tp={d['tensor_parallel']} share={d.get('gpu_memory_utilization', 'default')}"
                for d in r["deployments"]
            )
        )
        return 0
    if command == "verify":
        steps, recipe, logs = int(args[0]), Path(args[1]), [Path(p) for p in args[2:]]
        names = [d["name"] for d in tomllib.loads(recipe.read_text())["deployments"]]
        text = "\n".join(p.read_text(errors="replace") for p in logs if p.is_file())
        missing = missing_versions(text, names, steps)
        for name, versions in missing.items():
            print(f"deployment {name} never committed version(s) {versions} of 1..{steps}")
        if not missing:
            print(f"every deployment ({', '.join(names)}) committed all {steps} versions")
        return 1 if missing else 0
    raise SystemExit(f"unknown command {command!r} (recipe | verify)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
