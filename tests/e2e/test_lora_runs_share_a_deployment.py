"""LoRA runs of one base share a deployment on `looprl up`: its replicas load the base once and
serve every run's adapter, each request with its own run's adapter at its own run's version.

Three LoRA runs of one Hugging Face-format base (the tiny Qwen2 with the char tokenizer, warm-started
on the copy task: LoRA learns from there, where a base near uniform over its vocabulary gives it too
little signal) name the same `shared` deployment; only one set of
replica actors exists (`shared/<name>`), none per run. The third is stopped after a few steps and
the other two train on, to the end, and both learn (the mean reward of the last 10 steps above that
of the first 10). Every model turn on the bus records the adapter that sampled it: its own run's,
at a version of its own run (synchronous runs: step s sampled at version s), through its own view
of the shared deployment (`<run id>/<name>`). When the last run has
ended the shared replicas are gone.
"""

from __future__ import annotations

import time
import tomllib
from pathlib import Path

import pytest

from looprl.gateway.v1 import gateway_pb2
from services.kit.config.recipe import run_deployment_name
from services.modeling.config import ModelConfig
from services.modeling.hf_files import write_char_tokenizer
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.modeling.tokenizer import CharTokenizer
from tests.e2e.test_runs_side_by_side import _final, _model_turns, _ray_view
from tests.support.runs import assert_accounting
from tests.support.stack import Stack, local_stack
from tools.hf_warm_start import environment_examples, warm_start

pytestmark = pytest.mark.slow

# Single-process GRPO with this base and these settings (bench/single_process_grpo.py with the
# adapter injected): seeds 0 and 1 go from 0.73 to 0.92 over 60 steps.
STEPS, MARGIN = 60, 0.08
TASK_TOML = '{ min_len = 1, max_len = 1, ops = ["copy"] }'
TASK = tomllib.loads(f"task = {TASK_TOML}")["task"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora-base") / "tiny-char"
    model = Qwen2ForCausalLM(ModelConfig.tiny(), seed=None)
    model.init_weights(0, std=0.1)
    warm_start(model, CharTokenizer(), environment_examples("digits", TASK, 512, seed=1), 40, 0)
    model.save_pretrained(out)
    write_char_tokenizer(out)
    return out


def _recipe(base: Path, name: str, seed: int, steps: int) -> str:
    return f"""
[run]
name = "{name}"
seed = {seed}
steps = {steps}
[model]
path = "{base}"
tokenizer = "{base}"
[model.lora]
rank = 16
alpha = 32.0
target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
[environment]
name = "digits"
reward = "digits"
config = {TASK_TOML}
[sampling]
max_tokens = 6
[batch]
rollouts_per_step = 64
group_size = 8
[optimizer]
lr = 3e-3
warmup_steps = 2
[trainer]
world_size = 1
[[deployments]]
name = "lora"
shared = true
max_loras = 3
max_model_len = 128
max_batch_size = 64
"""


def _get(stack: Stack, run_id: str) -> gateway_pb2.Run:
    return stack.stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=stack.metadata).run


def _wait(stack: Stack, run_id: str, done, timeout: float, what: str) -> gateway_pb2.Run:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = _get(stack, run_id)
        if done(run):
            return run
        assert run.state != gateway_pb2.RUN_STATE_FAILED, f"{run_id} failed: {run.error}"
        time.sleep(1.0)
    raise AssertionError(f"{run_id}: {what} not within {timeout:.0f}s (state {run.state}, step {run.step})")


@pytest.mark.timeout(1200)
def test_lora_runs_of_one_base_share_a_deployment_and_never_mix_adapters(tmp_path, base) -> None:
    runs = {"lora-a": (0, STEPS), "lora-b": (1, STEPS), "lora-c": (2, 1000)}
    with local_stack(tmp_path / "state", recipe_text=None) as stack:
        for run_id, (seed, steps) in runs.items():
            stack.stub.CreateRun(
                gateway_pb2.CreateRunRequest(recipe_toml=_recipe(base, run_id, seed, steps), run_id=run_id),
                metadata=stack.metadata,
            )
        for run_id in runs:
            _wait(stack, run_id, lambda r: r.step >= 3, 400, "3 steps")
        actors = _ray_view(stack)["actors"]
        assert any(name.startswith("shared/lora/") for name in actors), actors
        assert not any(name.startswith(f"{run}/lora") for run in runs for name in actors), actors

        # Stopping one run leaves the others training on the same replicas.
        stack.stub.StopRun(gateway_pb2.StopRunRequest(run_id="lora-c"), metadata=stack.metadata)
        stopped = _wait(stack, "lora-c", _final, 120, "the stop")
        assert stopped.state == gateway_pb2.RUN_STATE_STOPPED
        steps_then = {r: _get(stack, r).step for r in ("lora-a", "lora-b")}
        for run_id, step in steps_then.items():
            _wait(stack, run_id, lambda r, s=step: r.step > s + 3 or _final(r), 300, "steps after the stop")

        done = {r: _wait(stack, r, _final, 900, "the end") for r in ("lora-a", "lora-b")}
        for run_id, run in done.items():
            assert run.state == gateway_pb2.RUN_STATE_COMPLETED, run.error
            assert_accounting(run)
            rewards = [h.reward_mean for h in run.history]
            first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
            assert last > first + MARGIN, f"{run_id}: first 10 steps {first:.3f}, last 10 {last:.3f}"
            # Every model turn: sampled through the run's view of the shared replicas with this run's
            # adapter, at this run's versions (step s at version s).
            turns = _model_turns(stack, run_id)
            assert turns and {t.adapter for t in turns} == {run_id}
            assert {t.deployment for t in turns} == {run_deployment_name(run_id, "lora")}
            assert max(t.weight_version for t in turns) == run.total_steps - 1
        deadline = time.monotonic() + 60
        while any(n.startswith("shared/lora/") for n in _ray_view(stack)["actors"]):
            assert time.monotonic() < deadline, "the shared replicas outlived their last run"
            time.sleep(2)
