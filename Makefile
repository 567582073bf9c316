# looprl: every command a newcomer needs. `make run` and `make test` set up first if needed.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
RECIPE ?= configs/digits_grpo.toml
PYTEST_ARGS ?=
# Where the local stack keeps its state and listens, e.g. make up STATE_DIR=/tmp/s PORTS="--base-port 52000"
STATE_DIR ?=
PORTS ?=
STACK_ARGS := $(if $(STATE_DIR),--state-dir $(STATE_DIR))

.PHONY: setup hf-model math-10m-model run test test-fast lint fmt protos check breaking up down status bench clean compose-up compose-down \
	vllm-side gpu-check

setup: $(STAMP)

# Re-run only when the dependency pins change; the project itself is installed editable.
$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements.lock -e '.[dev]'
	@touch $(STAMP)

# The small Hugging Face-format model configs/hf_math_grpo.toml trains (offline, deterministic).
hf-model: setup
	$(PY) tools/build_hf_model.py --out models/tiny-bpe-qwen2 --sft-steps 200

math-10m-model: setup
	$(PY) -m bench.peer_trl_realistic

run: setup
	$(VENV)/bin/looprl run $(RECIPE) --local $(STACK_ARGS) $(PORTS)

# vllm-side first: the pinned vLLM download runs under pip's timeouts, not inside one test's 300 s.
test: setup vllm-side
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-fast: setup vllm-side
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd protos && ../$(VENV)/bin/buf lint

fmt: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

protos: setup
	$(PY) tools/gen_protos.py

# Fails when generated code or docs are stale, anything is not lint-clean, or a typed seam does not
# type-check (mypy, configured in pyproject.toml). `make test` runs the same checks as tests.
check: setup lint
	$(PY) tools/gen_protos.py --check
	$(PY) tools/gen_config_docs.py --check
	$(PY) tools/gen_conformance_docs.py --check
	$(PY) tools/gen_bench_table.py --check
	$(VENV)/bin/mypy

# Breaking-change check of the contracts against main.
breaking: setup
	cd protos && ../$(VENV)/bin/buf breaking --against '../.git#branch=main,subdir=protos'

up: setup
	$(VENV)/bin/looprl up $(STACK_ARGS) $(PORTS)

down:
	@test -x $(VENV)/bin/looprl && $(VENV)/bin/looprl down $(STACK_ARGS) || true

status: setup
	$(VENV)/bin/looprl status $(STACK_ARGS)

# Benchmarks need the TRL peer (bench/peer_trl.py) beside the pinned torch and transformers.
bench: setup
	$(PY) -m pip install -q -c requirements.lock -e '.[peer]'
	$(PY) -m bench.all $(BENCH_ARGS)

# The pinned vLLM's Python sources beside our torch (no dependencies) in .vllm-side/ (gitignored),
# for the CPU tests of what we hand to vLLM (tests/support/vllm_side.py). Offline it warns and those
# tests skip; under CI (CI=true) it fails with pip's error.
vllm-side: setup
	$(PY) -m tests.support.vllm_side

# The prepared GPU check of the vLLM path (CUDA machine; see tools/gpu_check.sh).
gpu-check:
	bash tools/gpu_check.sh

# The containerised stack (needs a Docker engine): see deploy/README.md.
compose-up:
	docker compose up --build -d

compose-down:
	docker compose down

clean: down
	rm -rf .looprl reports
