"""Kill the trainer ranks after step k and resume from the sharded checkpoint: the parameters after
step k+2 equal those of an uninterrupted run, bit for bit (CPU, gloo)."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_steps import make_spec, make_step

from services.modeling.qwen2 import Qwen2ForCausalLM
from services.trainer.checkpoint import latest_checkpoint, read_state
from services.trainer.ranks import RankGroup

pytestmark = pytest.mark.slow

WORLD = 2
K = 2


def _steps(n: int):
    return [
        make_step(step=s, world_size=WORLD, micro_per_rank=2, seqs_per_micro=2, seed=100 + s)[0]
        for s in range(n)
    ]


def test_resume_after_kill_matches_uninterrupted_run(ray_client, tmp_path) -> None:
    steps = _steps(K + 2)
    spec = make_spec()

    crashed = RankGroup(WORLD)
    try:
        crashed.start(spec)
        for s in range(K):
            crashed.train_step(steps[s])
        path = crashed.save_checkpoint(str(tmp_path / "ckpt"), extra={"note": "step k"})
        crashed.train_step(steps[K])  # work after the checkpoint is lost with the ranks
        hf_dir = crashed.export_hf(str(tmp_path / "hf"))
    finally:
        crashed.shutdown()  # ray.kill: no clean exit, no final checkpoint

    assert (
        latest_checkpoint(tmp_path / "ckpt") is not None and str(latest_checkpoint(tmp_path / "ckpt")) == path
    )
    state = read_state(path)
    assert state["step"] == K and state["last_packer_step"] == K - 1 and state["extra"] == {"note": "step k"}

    # The exported HF directory loads as a plain model (and in transformers' format: config.json).
    exported = Qwen2ForCausalLM.from_pretrained(hf_dir)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen2"
    assert exported.model.embed_tokens.weight.shape[0] == spec.model_config().vocab_size

    group = RankGroup(WORLD)
    try:
        # One group serves both runs: first the uninterrupted one, then the resumed one on a fresh setup.
        group.start(spec)
        for s in range(K + 2):
            uninterrupted_metrics = group.train_step(steps[s])
        uninterrupted = group.call("full_state_dict")[0]

        group.call("setup", spec)  # forget everything, as a fresh process would
        restored = group.load_checkpoint(path)
        assert restored["step"] == K
        assert [s["step"] for s in group.call("state")] == [K, K]
        for s in range(K, K + 2):
            resumed_metrics = group.train_step(steps[s])
        resumed = group.call("full_state_dict")[0]
    finally:
        group.shutdown()

    assert resumed_metrics["lr"] == uninterrupted_metrics["lr"]  # the schedule resumed too
    assert resumed_metrics["loss"] == uninterrupted_metrics["loss"]
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name
