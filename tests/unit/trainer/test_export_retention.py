"""The Hugging Face exports a run keeps of the steps it evaluates (for `looprl eval RUN --step N`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.kit.config.recipe import parse_recipe
from services.trainer.checkpoint import export_dir, prune_exports
from services.trainer.config import TrainerConfig
from services.trainer.loop import RunTrainer


def _exports(root: Path, *steps: int) -> None:
    for step in steps:
        export_dir(root, step).mkdir(parents=True)
        (export_dir(root, step) / "config.json").write_text("{}")


def test_only_the_newest_exports_of_evaluated_steps_are_kept(tmp_path: Path) -> None:
    _exports(tmp_path, 0, 10, 13, 20, 30)  # 13: asked for through TrainerService.Checkpoint
    (tmp_path / "hf" / "step_00000040.partial").mkdir()  # an export being written
    removed = prune_exports(tmp_path / "hf", {0, 10, 20, 30, 40}, keep=2)
    assert removed == [export_dir(tmp_path, 0), export_dir(tmp_path, 10)]
    left = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert left == ["step_00000013", "step_00000020", "step_00000030", "step_00000040.partial"]


def test_a_run_exports_the_steps_it_evaluates_unless_the_trainer_keeps_none(tmp_path: Path) -> None:
    recipe = parse_recipe('[run]\nname = "e"\nsteps = 25\n[eval]\nevery = 10\n')
    # Step 0's weights are the run's initial model, which its recipe rebuilds: not exported.
    assert RunTrainer("e", recipe, TrainerConfig(state_dir=str(tmp_path))).evaluated == {10, 20, 25}
    none = TrainerConfig(state_dir=str(tmp_path), keep_eval_exports=0)
    assert RunTrainer("e", recipe, none).evaluated == frozenset()
    without_eval = parse_recipe('[run]\nname = "e"\nsteps = 25\n')
    assert RunTrainer("e", without_eval, TrainerConfig(state_dir=str(tmp_path))).evaluated == frozenset()


class _Ranks:
    """Stands in for the Ray rank group: steps train at once; exports are noted."""

    nodes = ("local",)

    def __init__(self) -> None:
        self.step = 0
        self.exports: list[tuple[str, int, list[int], int]] = []

    def start(self, spec) -> list[dict]:
        return [{"parameters": 1}]

    def pull_and_train(self, *args) -> dict:
        self.step += 1
        metrics = dict.fromkeys(("loss", "kl", "entropy", "grad_norm", "clip_fraction", "staleness"), 0.0)
        return {
            **metrics,
            "step": self.step - 1,
            "version": self.step,
            "max_staleness": 0,
            "num_tokens": 1,
            "tokens_per_second": 1.0,
        }

    def save_checkpoint(self, root, extra, keep) -> str:
        return f"{root}/step_{self.step:08d}"

    def export_hf(self, directory, evaluated, keep) -> str:
        self.exports.append((Path(directory).name, self.step, evaluated, keep))
        return directory

    def shutdown(self) -> None:
        pass


def test_the_trainer_exports_each_evaluated_step_after_0_once_as_it_trains_it(tmp_path: Path) -> None:
    recipe = parse_recipe(
        '[run]\nname = "e"\nsteps = 25\n[eval]\nevery = 10\n[trainer]\ncheckpoint_every = 0\n'
    )
    trainer = RunTrainer(
        "e", recipe, TrainerConfig(state_dir=str(tmp_path), keep_eval_exports=2, export_hf_at_end=False)
    )
    trainer.group = ranks = _Ranks()

    async def acked(below=None) -> None:
        trainer.unacked.clear()

    trainer._ack_pending = acked  # no packer to acknowledge to
    asyncio.run(trainer.run())
    assert trainer.state == "completed"
    # Each with the weights of its step (trained that far), the evaluated steps and how many to keep.
    assert ranks.exports == [(f"step_{step:08d}", step, [10, 20, 25], 2) for step in (10, 20, 25)]
