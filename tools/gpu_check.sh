#!/usr/bin/env bash
# The prepared GPU check of the vLLM path, one command on a CUDA machine (`make gpu-check`):
#
#   1. a vLLM environment ($VLLM_VENV, default .venv-vllm) from requirements/vllm.txt plus looprl's
#      runtime dependencies minus torch and transformers (vLLM pins those), looprl itself with
#      --no-deps (as deploy/docker/inference-router.gpu.Dockerfile does). With WHEELS=<dir> it
#      installs from carried wheels only (a machine with no package index);
#   2. every gpu-marked test (each tests/ module with pytest.mark.gpu; a skip there is a failure);
#   3. tools/gpu_vllm_probe.py: two vLLM deployments (tp=1 and tp=2 when two GPUs are visible,
#      else two tp=1), printing the weight-swap seconds per version, the log-prob drift trainer vs
#      vLLM after each update (against the canary's bound) and generated tokens/s;
#   4. 20 steps of configs/gpu_vllm_gsm8k.toml with the same two deployments (a small preset model
#      when the recipe's checkpoint is not on this machine), sized by tools/gpu_check_plan.py so
#      Ray can place the trainer and both replicas on 1, 2, 3 or 4+ GPUs, printing weight-sync's
#      seconds per version from its log and the run's report; it fails unless every deployment
#      committed every version 1..20.
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
# Every test module that marks a test `gpu` (conftest skips those without CUDA); here none may skip.
mapfile -t GPU_TESTS < <(grep -rlE "pytest\.mark\.gpu" tests --include='*.py' | sort)
say "gpu-marked tests: ${GPU_TESTS[*]}"
"$VPY" -m pytest -q -rs -m gpu -p no:cacheprovider "${GPU_TESTS[@]}" -s 2>&1 | tee "$OUT_DIR/gpu_tests.log"
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
  say "FAILED: gpu-marked tests"; status=1
elif grep -qE "^[0-9]+ .*skipped|^SKIPPED" "$OUT_DIR/gpu_tests.log"; then
  say "FAILED: gpu-marked tests skipped on a GPU machine (see SKIPPED in $OUT_DIR/gpu_tests.log)"; status=1
fi

# ---- 3. the two-deployment probe ----------------------------------------------------------------
say "probe: weight swap seconds, log-prob drift and tokens/s per version"
if ! "$VPY" -m tools.gpu_vllm_probe --versions 4 --out "$OUT_DIR/probe.json" 2>&1 | tee "$OUT_DIR/probe.log"; then
  say "FAILED: probe"; status=1
fi

# ---- 4. 20 steps of the GPU recipe ------------------------------------------------------------
# Sized so Ray can place every GPU request on this many GPUs (tools/gpu_check_plan.py says how).
say "$STEPS steps of configs/gpu_vllm_gsm8k.toml"
RECIPE="$OUT_DIR/gpu_check_recipe.toml"
"$VPY" -m tools.gpu_check_plan recipe "$GPUS" "$STEPS" "$RECIPE" | tee -a "$OUT_DIR/summary.txt" \
  || { say "FAILED: could not size the recipe"; exit 1; }
export LOOPRL_STATE_DIR="$OUT_DIR/state"
if ! timeout 420 "$VENV/bin/looprl" run "$RECIPE" --local --report-dir "$OUT_DIR" \
    2>&1 | tee "$OUT_DIR/run.log"; then
  say "FAILED: the $STEPS-step run (log: $OUT_DIR/run.log, services: $LOOPRL_STATE_DIR/logs)"; status=1
fi
say "weight-sync seconds per version (weight-sync's log)"
grep -ho "deployment [^ ]* now serves version [0-9]* ([0-9]* bytes, [0-9.]*s)" "$LOOPRL_STATE_DIR"/logs/*.log \
  2>/dev/null | tee -a "$OUT_DIR/summary.txt" || say "no weight-sync commits found in $LOOPRL_STATE_DIR/logs"
cat "$OUT_DIR"/*/summary.md 2>/dev/null | tee -a "$OUT_DIR/summary.txt"
if ! "$VPY" -m tools.gpu_check_plan verify "$STEPS" "$RECIPE" "$LOOPRL_STATE_DIR"/logs/*.log \
    | tee -a "$OUT_DIR/summary.txt"; then
  say "FAILED: not every version 1..$STEPS was committed on every deployment"; status=1
fi
say "done (status $status); everything is in $OUT_DIR"
exit $status
