"""Models users bring train end to end on the local stack: a Qwen3 (looprl's fast path) and a Gemma
(the generic path, transformers' own code in trainer and engine), each built offline from its config
by tools/build_hf_model.py, run side by side on one `looprl up`. Both complete every step; the
engine's log-probs of what it sampled at version 0 equal transformers' on the starting checkpoint;
and each run's export is a directory transformers loads as that architecture."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats.errors
import pytest
import torch
import transformers

from looprl.gateway.v1 import gateway_pb2
from services.kit.bus import nats_auth, subjects
from services.kit.bus.client import Bus
from services.kit.config.recipe import run_deployment_name
from services.kit.messages import rollouts as rollout_messages
from services.modeling.logprobs import token_logprobs
from tests.support.runs import assert_accounting
from tests.support.stack import Stack, local_stack
from tools.build_hf_model import build

pytestmark = pytest.mark.slow

STEPS = 5
ARCHS = {"qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM"}


def _recipe(arch: str, model: Path) -> str:
    return f"""
[run]
name = "byo-{arch}"
steps = {STEPS}
[model]
path = "{model}"
tokenizer = "{model}"
[environment]
name = "digits"
reward = "digits"
config = {{ min_len = 1, max_len = 2, ops = ["copy"] }}
[sampling]
max_tokens = 6
temperature = 1.0
[batch]
rollouts_per_step = 16
group_size = 4
[trainer]
world_size = 1
checkpoint_every = 0
[[deployments]]
name = "{arch}"
max_model_len = 128
max_batch_size = 16
"""


async def _rollouts(stack: Stack, run_id: str) -> list:
    bus = await Bus.connect(stack.state.nats_url_for(nats_auth.OPERATOR), name="e2e-byo")
    try:
        sub = await bus.js.subscribe(subjects.rollouts(run_id), ordered_consumer=True)
        out = []
        while True:
            try:
                msg = await sub.next_msg(timeout=2.0)
            except nats.errors.TimeoutError:
                return out
            out += rollout_messages.decode(msg.data, msg.headers)
    finally:
        await bus.close()


@pytest.mark.timeout(900)
def test_a_qwen3_and_a_gemma_train_side_by_side_and_export(tmp_path) -> None:
    models = {}
    for arch in ARCHS:
        models[arch] = tmp_path / arch
        build(
            models[arch],
            seed=2,
            arch=arch,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            head_dim=16,
            vocab_size=400,
        )
    with local_stack(tmp_path / "state", recipe_text=None) as stack:
        for arch, path in models.items():
            stack.stub.CreateRun(
                gateway_pb2.CreateRunRequest(recipe_toml=_recipe(arch, path), run_id=f"byo-{arch}"),
                metadata=stack.metadata,
            )
        runs = {}
        deadline = time.monotonic() + 600
        while len(runs) < len(ARCHS) and time.monotonic() < deadline:
            for arch in ARCHS:
                run = stack.stub.GetRun(
                    gateway_pb2.GetRunRequest(run_id=f"byo-{arch}"), metadata=stack.metadata
                ).run
                assert run.state != gateway_pb2.RUN_STATE_FAILED, f"{arch}: {run.error}"
                if run.state == gateway_pb2.RUN_STATE_COMPLETED:
                    runs[arch] = run
            time.sleep(1.0)
        assert set(runs) == set(ARCHS), f"not completed in time: {set(ARCHS) - set(runs)}"

        for arch, run in runs.items():
            assert_accounting(run)
            assert run.weight_version == STEPS
            rollouts = asyncio.run(_rollouts(stack, run.run_id))
            first = [r for r in rollouts if r.max_weight_version == 0]
            assert first, f"{arch}: no rollouts of version 0"
            # The engine sampled version 0 = the starting checkpoint: transformers agrees on every token.
            hf = transformers.AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32).eval()
            for rollout in first[:8]:
                ids, offset = [], []
                for turn in rollout.turns:
                    if turn.trainable:
                        assert turn.deployment == run_deployment_name(run.run_id, arch)
                        offset.append((len(ids), turn))
                    ids += list(turn.token_ids)
                full = torch.tensor(ids)
                with torch.no_grad():
                    ref = token_logprobs(hf(full[None]).logits[0], full, torch.tensor([0, len(full)]))
                for start, turn in offset:
                    got = torch.tensor(list(turn.logprobs))
                    torch.testing.assert_close(got, ref[start : start + len(got)], atol=1e-4, rtol=0)

            exports = sorted((stack.state_dir).rglob(f"{run.run_id}/hf/step_*"))
            assert exports, f"{arch}: no export under {stack.state_dir}"
            exported = transformers.AutoModelForCausalLM.from_pretrained(exports[-1], dtype=torch.float32)
            assert type(exported).__name__ == ARCHS[arch]
            assert transformers.AutoTokenizer.from_pretrained(exports[-1]).eos_token_id is not None
