#!/usr/bin/env bash
# The prepared GPU check of the vLLM path, one command on a CUDA machine (`make gpu-check`):
#
#   1. a vLLM environment ($VLLM_VENV, default .venv-vllm) from requirements/vllm.txt plus looprl's
#      runtime dependencies minus torch and transformers (vLLM pins those), looprl itself with
#      --no-deps (as deploy/docker/inference-router.gpu.Dockerfile does). With WHEELS=<dir> it
#      installs from carried wheels only (a machine with no package index);
#   2. the gpu-marked tests;
#   3. tools/gpu_vllm_probe.py: two vLLM deployments (tp=1 and tp=2 when two GPUs are visible,
#      else two tp=1), printing the weight-swap seconds per version, the log-prob drift trainer vs
#      vLLM after each update (against the canary's bound) and generated tokens/s;
#   4. 20 steps of configs/gpu_vllm_gsm8k.toml with the same two deployments (a small preset model
#      when the recipe's checkpoint is not on this machine), printing weight-sync's seconds per
#      version from its log and the run's report.
#
# Budget: ~8 minutes on one H200 once the environment exists (each vLLM start ~30-60 s, eager).
# Everything printed also lands in $OUT_DIR (default reports/gpu-check). Exit status: 0 all passed,
# 1 a check failed, 3 the vLLM environment could not be built here (the message says why).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-reports/gpu-check}
VENV=${VLLM_VENV:-.venv-vllm}
STEPS=${STEPS:-20}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
status=0

say() { echo "== $*" | tee -a "$OUT_DIR/summary.txt"; }

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  say "no NVIDIA GPU visible: nothing to check"; exit 3
fi
GPUS=$(nvidia-smi -L | wc -l)
say "$GPUS GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"

# ---- 1. the vLLM environment ------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm, services" 2>/dev/null; then
  "$PY" -m venv "$VENV" || { say "cannot create $VENV"; exit 3; }
  "$PY" -c "import tomllib; deps = tomllib.load(open('pyproject.toml','rb'))['project']['dependencies']; \
print('\n'.join(d for d in deps if not d.startswith(('torch', 'transformers'))))" > "$OUT_DIR/deps.txt"
  echo "pytest==9.2.0 pytest-asyncio==1.5.0 pytest-timeout==2.4.0" | tr ' ' '\n' >> "$OUT_DIR/deps.txt"
  if [ -n "${WHEELS:-}" ]; then
    PIP_ARGS=(--no-index --find-links "$WHEELS")
  else
    PIP_ARGS=()
  fi
  if ! "$VENV/bin/python" -m pip install -q "${PIP_ARGS[@]}" -r requirements/vllm.txt -r "$OUT_DIR/deps.txt" \
      > "$OUT_DIR/pip.log" 2>&1; then
    say "the vLLM environment could not be installed (vllm==0.33.0 and its CUDA torch come from a package"
    say "index or WHEELS=<dir of wheels>); last lines of $OUT_DIR/pip.log:"
    tail -5 "$OUT_DIR/pip.log"
    exit 3
  fi
  "$VENV/bin/python" -m pip install -q --no-deps -e . >> "$OUT_DIR/pip.log" 2>&1 || { say "looprl install failed"; exit 3; }
fi
VPY="$VENV/bin/python"
say "$("$VPY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__, "cuda", torch.version.cuda)')"

# ---- 2. gpu-marked tests ----------------------------------------------------------------------
say "gpu-marked tests"
if ! "$VPY" -m pytest -q -m gpu -p no:cacheprovider tests/integration/test_engine_vllm.py \
    tests/unit/weight_sync/test_weightsync_gpu.py -s 2>&1 | tee "$OUT_DIR/gpu_tests.log"; then
  say "FAILED: gpu-marked tests"; status=1
fi

# ---- 3. the two-deployment probe ----------------------------------------------------------------
say "probe: weight swap seconds, log-prob drift and tokens/s per version"
if ! "$VPY" -m tools.gpu_vllm_probe --versions 4 --out "$OUT_DIR/probe.json" 2>&1 | tee "$OUT_DIR/probe.log"; then
  say "FAILED: probe"; status=1
fi

# ---- 4. 20 steps of the GPU recipe ------------------------------------------------------------
say "$STEPS steps of configs/gpu_vllm_gsm8k.toml"
"$VPY" - "$GPUS" "$STEPS" "$OUT_DIR/gpu_check_recipe.toml" <<'EOF'
import sys, tomllib
from pathlib import Path

gpus, steps, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
r = tomllib.loads(Path("configs/gpu_vllm_gsm8k.toml").read_text())
r["run"]["steps"] = steps
if not Path(r["model"]["path"]).is_dir():  # no checkpoint on this machine: a preset architecture
    r["model"] = {"path": "", "preset": "small-qwen2", "tokenizer": "char", "dtype": "bfloat16"}
r["environment"]["config"]["dataset"] = str(Path("configs/data/gsm8k_sample.jsonl").resolve())
r["sampling"]["max_tokens"] = 256
r["batch"].update(rollouts_per_step=64, group_size=8, max_tokens_per_microbatch=8192)
# One GPU: the trainer rank shares it with both replicas (0.35 of its memory each, by Ray's count too).
r["trainer"].update(world_size=1, checkpoint_every=0, num_gpus_per_rank=0.3 if gpus == 1 else 1.0)
second_tp = 2 if gpus >= 3 else 1  # tp=1 (1 GPU) + tp=2 (2 GPUs) needs three; else two tp=1
for d, tp in zip(r["deployments"], (1, second_tp)):
    d.update(tensor_parallel=tp, replicas=1, max_model_len=1024, model_path=r["model"]["path"])
    if gpus == 1:  # both tp=1 replicas on the one GPU, each with its share of memory
        d["gpu_memory_utilization"] = 0.35
    d["max_output_tokens"] = min(d.get("max_output_tokens", 1 << 30), 1 << 30)
r["deployments"][1]["max_model_len"] = 1024
r["deployments"][1]["min_output_tokens"] = 0

def value(v):
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
for section, body in r.items():
    if section == "deployments":
        continue
    lines.append(f"[{section}]")
    lines += [f"{k} = {value(v)}" for k, v in body.items()]
for d in r["deployments"]:
    lines.append("[[deployments]]")
    lines += [f"{k} = {value(v)}" for k, v in d.items()]
out.write_text("\n".join(lines) + "\n")
print("recipe:", out, "deployments", [(d["name"], d["tensor_parallel"]) for d in r["deployments"]])
EOF
export LOOPRL_STATE_DIR="$OUT_DIR/state"
if ! timeout 420 "$VENV/bin/looprl" run "$OUT_DIR/gpu_check_recipe.toml" --local --report-dir "$OUT_DIR" \
    2>&1 | tee "$OUT_DIR/run.log"; then
  say "FAILED: the $STEPS-step run (log: $OUT_DIR/run.log, services: $LOOPRL_STATE_DIR/logs)"; status=1
fi
say "weight-sync seconds per version (weight-sync's log)"
grep -ho "deployment [^ ]* now serves version [0-9]* ([0-9]* bytes, [0-9.]*s)" "$LOOPRL_STATE_DIR"/logs/*.log \
  2>/dev/null | tee -a "$OUT_DIR/summary.txt" || say "no weight-sync commits found in $LOOPRL_STATE_DIR/logs"
cat "$OUT_DIR"/*/summary.md 2>/dev/null | tee -a "$OUT_DIR/summary.txt"
say "done (status $status); everything is in $OUT_DIR"
exit $status
