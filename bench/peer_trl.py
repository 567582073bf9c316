"""looprl against Hugging Face TRL's GRPOTrainer: the same recipe, learned by both, in the same run.

Two shapes (`--shape tiny|realistic|both`). The tiny one is the default recipe
(configs/digits_grpo.toml); the realistic one, a ~10M-parameter Qwen2 on math word problems with up
to 96 output tokens, is bench/peer_trl_realistic.py. For the tiny shape everything that can be
identical is made identical and checked before anything is measured (`check_parity`): the Qwen2
config and the initial weights (logits equal on a prompt), the token ids (a `PreTrainedTokenizerFast`
over CharTokenizer's vocabulary with the same ChatML template), the tasks in order (looprl's
`task_by_index`, TRL with `shuffle_dataset=False`), the reward (`digits_score` on the completion
decoded without special tokens) and the optimizer (looprl's own AdamW + warmup schedule handed to
TRL), and the first update itself: the same 64 completions, sampled once by looprl's engine and
replayed into TRL's step, move both models' weights alike (within 1% of the update's L2 norm). The
loss settings map as in shared/peer-trl-mapping.md: token-mean over the step = TRL
`loss_type="dapo"`, Dr. GRPO advantages = `scale_rewards="none"`, clip 0.2/0.28, entropy bonus, grad
clip, one optimizer step per generation batch.

Both sides run alternating per seed (TRL, then looprl's services on a fresh local stack, then, for
the tiny shape, looprl's libraries in one process, then TRL again on another sampling stream), so
machine noise hits them alike. TRL is synchronous; looprl runs the recipe as written for the tiny
shape and its best configuration for the realistic one (printed with the figure), its run starting
its own deployments as `looprl run --local` does. Per seed it prints steps/s over two clock windows,
the same on both sides: first -> last step (the first step excluded), and run created -> completed
as a user sees it (looprl: CreateRun to COMPLETED; TRL: train() to its return), and the mean reward
of the last 10 steps. Figures per shape: reward_ratio (looprl / TRL of the seed means),
reward_noise_floor (TRL on another sampling stream / TRL: the same algorithm against itself),
steps_per_s_ratio (first -> last step), steps_per_s_ratio_<shape>_run_created_to_completed,
local_stack_up_down_s (looprl's stack up + down around a run, against TRL's trainer set-up), and for
the tiny shape reward_vs_single_process:

    python -m bench.peer_trl [--shape both] [--seeds 1,2,3] [--steps 400] [--world-size 1] [--quick]

Why ten seeds by default for the tiny shape: a run's final reward depends mostly on when, in 400
steps, the policy starts reading the prompt, and that depends on the sampled tokens: TRL against
itself on another sampling stream (reward_noise_floor_tiny) strays as far from 1 as a single seed's
gap between looprl and TRL. The per-seed paired gaps printed at the end, with their standard errors,
say whether a gap between looprl and TRL is more than that.

`--quick` runs one seed for a few steps per shape (a smoke run: ratios then mean little). TRL is an
optional bench dependency (`make bench` installs it: `pip install -c requirements.lock -e '.[peer]'`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import emit
from bench.loop_harness import with_overrides
from bench.peer_shape import Shape, check_same_inputs, prompts
from bench.peer_trl_realistic import REALISTIC
from services.environment_sandbox.environments.digits import digits_score
from services.kit.config.recipe import Recipe, parse_recipe
from services.modeling.config import model_preset
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.modeling.tokenizer import IM_END, PAD, SPECIAL_TOKENS, CharTokenizer
from services.trainer.optim import build_optimizer

BENCH = "peer_trl"
ROOT = Path(__file__).resolve().parent.parent
TINY_RECIPE = ROOT / "configs" / "digits_grpo.toml"
LAST_STEPS = 10
# TRL's second sampling stream for the noise floor: GRPOConfig.seed = run seed + this.
RESAMPLED_SEED_OFFSET = 1000
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class SideResult:
    """One side's run of one seed."""

    rewards: list[float]
    steps_per_s: float
    """From the first step's end to the last's."""
    wall_seconds: float
    """As the user sees a run: looprl's from CreateRun to COMPLETED, TRL's from train() to its return."""
    overhead_seconds: float = 0.0
    """Around the training: TRL's trainer set-up; looprl's local stack up and down."""

    @property
    def final_reward(self) -> float:
        return statistics.fmean(self.rewards[-LAST_STEPS:])


# ---- identical parts ----------------------------------------------------------------------------


def char_tokenizer_fast() -> Any:
    """CharTokenizer as a transformers tokenizer: WordLevel over its vocabulary in id order, one token
    per character, unknown characters as '?', ChatML specials as single tokens."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    char = CharTokenizer()
    vocab = {char.decode([i]): i for i in range(char.vocab_size)}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="?"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token=IM_END, pad_token=PAD, chat_template=CHATML_TEMPLATE
    )


def hf_policy(recipe: Recipe) -> tuple[Any, Qwen2ForCausalLM]:
    """transformers' Qwen2ForCausalLM holding exactly looprl's initial weights, and looprl's model."""
    from transformers import Qwen2Config
    from transformers import Qwen2ForCausalLM as HFQwen2

    config = model_preset(recipe.model.preset)
    ours = Qwen2ForCausalLM(config, seed=None)
    ours.init_weights(recipe.run.seed, std=recipe.model.init_std)
    theirs = HFQwen2(Qwen2Config(**config.to_hf_dict()))
    theirs.load_state_dict(ours.hf_state_dict(), strict=False)
    theirs.tie_weights()
    tokenizer = CharTokenizer()
    theirs.generation_config.eos_token_id = tokenizer.eos_token_id
    theirs.generation_config.pad_token_id = tokenizer.pad_token_id
    return theirs, ours


def digits_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """The stack's `digits` reward on each completion's text (TRL decodes without special tokens)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [digits_score(text, target) for text, target in zip(texts, answer, strict=True)]


def check_parity(recipe: Recipe) -> None:
    """Raise unless model, init, tokenizer, template, tasks and the first update are the same on both sides."""
    hf_model, ours = hf_policy(recipe)
    texts = ("rev 123", "<|im_start|>user\nx<|im_end|>", "tab\there  é", "\n\n  ~")
    check_same_inputs(recipe, char_tokenizer_fast(), CharTokenizer(), texts, hf_model, ours, 1e-5)
    gap, update = one_step_update_gap(recipe)
    assert gap < 0.01 * update, f"one update on the same completions differs by {gap} (update norm {update})"


def one_step_update_gap(recipe: Recipe) -> tuple[float, float]:
    """L2 norm of the difference between TRL's and looprl's first update on the same 64 completions
    (sampled once by looprl's engine and handed to both), and the norm of the update itself. A norm,
    not the largest element: Adam's first step moves a weight by lr * g / (|g| + eps), so a weight
    whose gradient is near eps moves by an amount that tiny rounding differences change a lot."""
    from bench.single_process_grpo import GRPOSettings, Rollout, SingleProcessGRPO

    char = CharTokenizer()
    looprl = SingleProcessGRPO(GRPOSettings.from_recipe(TINY_RECIPE, seed=recipe.run.seed, threads=0))
    rows = prompts(recipe)[: recipe.groups_per_step]
    initial = {k: v.clone() for k, v in looprl.policy.hf_state_dict().items()}

    async def sample() -> list[Rollout]:
        await looprl.start()
        try:
            return await looprl.rollouts(0)
        finally:
            await looprl.close()

    rollouts = asyncio.run(sample())
    for r, row in zip(rollouts[:: recipe.batch.group_size], rows, strict=True):
        assert r.prompt_ids == char.apply_chat_template(row["prompt"]), (
            "looprl's step-0 prompts differ from TRL's"
        )
    batch, _ = looprl.pack(0, rollouts)
    looprl.train(batch)
    ours = looprl.policy.hf_state_dict()
    with tempfile.TemporaryDirectory(prefix="looprl-peer-trl-") as out:
        trainer = trl_trainer(recipe, TINY, out)
        trainer.args.max_steps = 1

        def replay(prompt_ids, *_: Any, **__: Any) -> tuple[list[list[int]], None]:
            assert [list(p) for p in prompt_ids] == [r.prompt_ids for r in rollouts]
            return [r.completion_ids for r in rollouts], None

        trainer._generate_single_turn = replay
        trainer.train()
        theirs = trainer.model.state_dict()
    gap = sum(float((ours[k] - theirs[k]).square().sum()) for k in ours) ** 0.5
    update = sum(float((ours[k] - initial[k]).square().sum()) for k in ours) ** 0.5
    return gap, update


# ---- the two sides ------------------------------------------------------------------------------


def _optimizer(model: Any, recipe: Recipe) -> tuple[Any, Any]:
    """looprl's own AdamW and schedule, as the trainer builds them from the recipe."""
    return build_optimizer(list(model.parameters()), recipe.optimizer, recipe.run.steps)


def trl_trainer(
    recipe: Recipe, shape: Shape, output_dir: str, callbacks: list[Any] = (), stream: int = 0
) -> Any:
    """A GRPOTrainer set up as shared/peer-trl-mapping.md maps the recipe. `stream` picks TRL's sampling
    random stream (the HF Trainer seeds torch's global generator, which `generate` draws from, with
    `GRPOConfig.seed`); the initial weights are the shape's whatever the stream."""
    from datasets import Dataset
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    model = shape.trl_model(recipe)
    opt, algo, sampling = recipe.optimizer, recipe.algorithm, recipe.sampling
    assert algo.advantage == "dr_grpo" and algo.loss_aggregation == "token-mean" and algo.kl_coef == 0
    config = GRPOConfig(
        output_dir=output_dir,
        seed=recipe.run.seed + stream * RESAMPLED_SEED_OFFSET,
        max_steps=recipe.run.steps,
        per_device_train_batch_size=recipe.batch.rollouts_per_step,
        num_generations=recipe.batch.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        loss_type="dapo",
        scale_rewards="none",
        epsilon=algo.clip_low,
        epsilon_high=algo.clip_high,
        beta=0.0,
        entropy_coef=algo.entropy_coef,
        learning_rate=opt.lr,
        adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps,
        weight_decay=opt.weight_decay,
        max_grad_norm=opt.grad_clip,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        shuffle_dataset=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=shape.reward,
        args=config,
        train_dataset=Dataset.from_list(prompts(recipe)),
        processing_class=shape.trl_tokenizer(recipe),
        optimizers=_optimizer(model, recipe),
        callbacks=list(callbacks),
    )
    trainer.remove_callback(PrinterCallback)  # a dict per step on stdout otherwise
    return trainer


def run_trl(recipe: Recipe, shape: Shape, threads: int = 2, stream: int = 0) -> SideResult:
    """TRL's GRPOTrainer on the recipe, in this process, sampling from random stream `stream`."""
    from transformers import TrainerCallback

    torch.set_num_threads(threads)
    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory(prefix="looprl-peer-trl-") as out:
        setup = time.perf_counter()
        trainer = trl_trainer(recipe, shape, out, [StepClock()], stream)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    steady = step_ends[-1] - step_ends[0]
    return SideResult(rewards, (len(step_ends) - 1) / max(steady, 1e-9), wall, start - setup)


def run_looprl(recipe_text: str, run_id: str) -> SideResult:
    """The services loop on a fresh local stack (gateway + every service in its own process), the
    run starting its own deployments as `looprl run --local` does."""
    from bench.loop_harness import run_on_fresh_stack

    start = time.perf_counter()
    result = run_on_fresh_stack(recipe_text, run_id, run_starts_deployments=True)
    total = time.perf_counter() - start
    rewards = [h.reward_mean for h in sorted(result.run.history, key=lambda h: h.step)]
    return SideResult(rewards, result.steps_per_second, result.wall_seconds, total - result.wall_seconds)


def run_single_process(seed: int, steps: int) -> SideResult:
    """looprl's own libraries in one process (bench/single_process_grpo.py), on the same tasks and seeds."""
    from bench.single_process_grpo import GRPOSettings, run_sync, summarize

    records = run_sync(GRPOSettings.from_recipe(TINY_RECIPE, seed=seed, steps=steps, threads=2))
    figures = summarize(records)
    return SideResult([r.mean_reward for r in records], figures["steps_per_s"], figures["wall_seconds"])


def with_seed_and_steps(recipe_text: str, seed: int, steps: int, world_size: int = 0) -> str:
    """The recipe at this seed and length; `world_size` > 0 also sets how many trainer ranks train
    it (a deployment choice: the algorithm and the step's token-mean are the same)."""
    sections: dict[str, dict[str, object]] = {"run": {"seed": seed, "steps": steps}}
    if world_size > 0:
        sections["trainer"] = {"world_size": world_size}
    return with_overrides(recipe_text, **sections)


# ---- the bench ----------------------------------------------------------------------------------


def paired_gap(a: list[SideResult], b: list[SideResult]) -> tuple[float, float]:
    """Mean and standard error of the per-seed differences of the final rewards a - b."""
    diffs = [x.final_reward - y.final_reward for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    return statistics.fmean(diffs), se


TINY = Shape(
    name="tiny",
    recipe_text=TINY_RECIPE.read_text,
    trl_model=lambda recipe: hf_policy(recipe)[0],
    trl_tokenizer=lambda _: char_tokenizer_fast(),
    reward=digits_reward,
    check_parity=check_parity,
    speed_target=">= 0.7",
    single_process=True,
)


def compare(shape: Shape, seeds: list[int], steps: int, world_size: int = 0) -> dict[str, float]:
    base = shape.recipe_text()
    looprl_recipe = parse_recipe(with_overrides(base, **shape.looprl_overrides))
    trl_runs: list[SideResult] = []
    resampled: list[SideResult] = []
    ours: list[SideResult] = []
    single: list[SideResult] = []
    tag = shape.name
    for seed in seeds:
        text = with_seed_and_steps(base, seed, steps, world_size)
        recipe = parse_recipe(text)
        shape.check_parity(recipe)
        trl_runs.append(run_trl(recipe, shape))
        looprl_text = with_overrides(text, **shape.looprl_overrides)
        ours.append(run_looprl(looprl_text, f"peer-{tag}-s{seed}-{int(time.time())}"))
        if shape.single_process:
            single.append(run_single_process(seed, steps))
        if shape.noise_floor:
            resampled.append(run_trl(recipe, shape, stream=1))
        print(
            f"[{tag}] seed {seed}: looprl ({recipe.trainer.world_size} trainer ranks, "
            f"max_staleness {looprl_recipe.run.max_staleness}) "
            f"{ours[-1].steps_per_s:.2f} steps/s ({steps / ours[-1].wall_seconds:.2f} created -> "
            f"completed), last-{LAST_STEPS} reward "
            f"{ours[-1].final_reward:.3f}, stack up+down {ours[-1].overhead_seconds:.1f}s | TRL "
            f"{trl_runs[-1].steps_per_s:.2f} steps/s ({steps / trl_runs[-1].wall_seconds:.2f} train() "
            f"-> return), reward {trl_runs[-1].final_reward:.3f}, "
            f"set-up {trl_runs[-1].overhead_seconds:.1f}s"
            + (f" (other sampling stream {resampled[-1].final_reward:.3f})" if resampled else "")
            + (f" | single process reward {single[-1].final_reward:.3f}" if single else ""),
            flush=True,
        )
        if steps <= 60:
            print(
                f"[{tag}] seed {seed} rewards per step: looprl {_curve(ours[-1])} | TRL {_curve(trl_runs[-1])}"
            )
    speed = [o.steps_per_s / t.steps_per_s for o, t in zip(ours, trl_runs, strict=True)]
    # As the user sees it: the same steps over the whole run, first step and start-up included.
    seen = [t.wall_seconds / o.wall_seconds for o, t in zip(ours, trl_runs, strict=True)]
    print(f"[{tag}] steps/s ratio per seed, first -> last step: {', '.join(f'{r:.2f}' for r in speed)}")
    print(f"[{tag}] steps/s ratio per seed, run created -> completed: {', '.join(f'{r:.2f}' for r in seen)}")
    others = [("looprl - TRL", ours)]
    others += [("single process - TRL", single)] if single else []
    others += [("TRL other stream - TRL", resampled)] if resampled else []
    for name, side in others:
        gap, se = paired_gap(side, trl_runs)
        print(f"[{tag}] reward gap {name}: {gap:+.3f} +- {se:.3f} (mean +- standard error over seeds)")

    def mean(runs: list[SideResult], key: str) -> float:
        return statistics.fmean(getattr(r, key) for r in runs)

    looprl_reward, trl_reward = mean(ours, "final_reward"), mean(trl_runs, "final_reward")
    unit = f"mean last-{LAST_STEPS} reward over seeds {seeds}"
    figures = [(f"reward_ratio_{tag}", looprl_reward, trl_reward, ">= 0.9")]
    if single:
        figures.append(
            (f"reward_vs_single_process_{tag}", looprl_reward, mean(single, "final_reward"), ">= 1.0")
        )
    if resampled:
        # The same algorithm (TRL) against itself with another sampling stream: how far the ratio of
        # two equal learners strays on these seeds, the yardstick for the figures above.
        figures.append(
            (
                f"reward_noise_floor_{tag}",
                mean(resampled, "final_reward"),
                trl_reward,
                "none: the spread of equals",
            )
        )
    for figure, value, baseline, target in figures:
        # No ratio against a reward of 0: the shape then says nothing about learning.
        emit(BENCH, figure, value, baseline, value / baseline if baseline > 0 else None, unit, target)
    looprl_speed, trl_speed = mean(ours, "steps_per_s"), mean(trl_runs, "steps_per_s")
    ranks = world_size or looprl_recipe.trainer.world_size
    sides = (
        f"looprl with {ranks} trainer ranks, max_staleness {looprl_recipe.run.max_staleness}; TRL synchronous"
    )
    emit(
        BENCH,
        f"steps_per_s_ratio_{tag}",
        looprl_speed,
        trl_speed,
        looprl_speed / trl_speed,
        f"steps/s, first -> last step ({sides})",
        shape.speed_target,
        samples=speed,
    )
    looprl_seen = statistics.fmean(steps / o.wall_seconds for o in ours)
    trl_seen = statistics.fmean(steps / t.wall_seconds for t in trl_runs)
    emit(
        BENCH,
        f"steps_per_s_ratio_{tag}_run_created_to_completed",
        looprl_seen,
        trl_seen,
        looprl_seen / trl_seen,
        f"steps/s, run created -> completed: looprl's CreateRun to COMPLETED, its deployments started "
        f"by the run as `looprl run --local` does; TRL's train() to its return ({sides})",
        shape.speed_target,
        samples=seen,
    )
    overhead, setup = mean(ours, "overhead_seconds"), mean(trl_runs, "overhead_seconds")
    emit(
        BENCH,
        "local_stack_up_down_s" + ("" if tag == "tiny" else f"_{tag}"),
        overhead,
        setup,
        overhead / max(setup, 1e-9),
        "s (TRL: trainer set-up)",
        "< 15 s" if tag == "tiny" else "reference",
        checks="value",
    )
    return {"reward": looprl_reward, "trl_reward": trl_reward}


def _curve(side: SideResult) -> str:
    return " ".join(f"{r:.2f}" for r in side.rewards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("tiny", "realistic", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="one seed, a few steps per shape")
    parser.add_argument("--seeds", default="", help="comma-separated (default: 1-10 tiny, 1-3 realistic)")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default: the recipe's)")
    parser.add_argument(
        "--world-size", type=int, default=0, help="looprl's trainer ranks (default: the recipe's)"
    )
    args = parser.parse_args()
    for shape, default_seeds, quick_steps in ((TINY, range(1, 11), 40), (REALISTIC, range(1, 4), 6)):
        if args.shape not in (shape.name, "both"):
            continue
        seeds = [1] if args.quick else [int(s) for s in args.seeds.split(",") if s] or list(default_seeds)
        steps = quick_steps if args.quick else args.steps or parse_recipe(shape.recipe_text()).run.steps
        compare(shape, seeds, steps, args.world_size)


if __name__ == "__main__":
    main()
