"""Single-process GRPO: the whole learning loop's work in one Python process, on the services' libraries.

This is the baseline the service loop is measured against (bench/loop_vs_single_process.py) and the
place where the default recipe is tuned. One step does what the services do together, with no
gRPC, NATS or Ray in between:

1. draw `rollouts_per_step / group_size` tasks from the environment's generator and render the
   environment's opening messages with the tokenizer's chat template (environment-sandbox);
2. generate `group_size` completions per prompt with the embedded CPU inference engine
   (inference-router's CPUEngine: continuous batching, per-sequence seeded sampling, log-probs under
   softmax(logits / temperature) before truncation), stopping at the tokenizer's eos (<|im_end|>);
3. score every completion with the environment (DigitsEnv.step -> digits_score, the reward service's
   verifier);
4. turn each episode into a rollout proto, validate it into a token sequence, group it, compute
   group-relative advantages and pack the step into micro-batches (rollout-packer);
5. check the micro-batches like the trainer does, recompute log-probs (services/modeling/logprobs.py),
   take the policy loss (trainer/loss.py) with gradient accumulation, clip, AdamW + schedule;
6. swap the new weights into the engine as the next version (weight-sync's job) and repeat.

    python -m bench.single_process_grpo --steps 30 [--quick] [--seed 1] [--lr 3e-3] ...

The recipe that genuinely learns (configs/digits_grpo.toml + the two settings the recipe format
cannot carry yet):

    python -m bench.single_process_grpo --init-std 0.1 --entropy-coef 0.0075 --quiet

Findings behind it (digits rev 2-3, 64 rollouts in groups of 8, max_tokens 4; reward = first-3 ->
last-5 step mean; "format ceiling" = 0.1 length bonus + 0.9 * 1/10 chance per digit = 0.19):

* No plumbing bug. Checked: engine log-probs equal trainer log-probs (max diff 1e-6) also on a
  teacher-forced model that reverses correctly (sampled reward 0.99), so the KV-cache path attends
  to the prompt like the packed forward; every packed sequence's advantage equals (r - mean)/std of
  its own group recomputed from its decoded tokens; no advantage or log-prob on prompt tokens; one
  step raises the log-prob of above-average samples (test in tests/unit/bench/).
* The collapse is an exploration failure: the policy settles on one fixed answer ("888") before
  the prompt-conditioned answer forms: entropy 4.6 -> 0 in ~75-100 steps, every sample of a group
  equal, advantages all 0, reward stuck at the ~0.19 ceiling. Seen with lr 1e-3/3e-3/1e-2, 256
  rollouts in groups of 16, and even on the 1-digit task (0.12-0.21 after 300 steps). Std-normalised
  GRPO makes it worse: once one digit dominates, groups whose target is that digit always carry
  unit-scale signal towards it while the others carry signal only on a rare hit.
* An entropy bonus sized to the advantage scale prevents it. With dr_grpo (advantage r - mean,
  ~0.1-0.3 here): 0 collapses (0.11), 0.05 keeps the policy uniform (0.02), 0.01 learns on 2 of 3
  seeds (0.51, 0.61, 0.12: seed 3 stays near-uniform), 0.005 on 3 (0.37, 0.36, 0.24), 0.0075 on 3
  (0.33, 0.37, 0.44). GRPO's unit-scale advantages need a ~4x larger bonus: 0.01 and 0.0075 collapse
  (0.20, 0.11), 0.03 learns (seeds 1-3: 0.35, 0.33, 0.35), 0.05 stays uniform. lr 1e-2 fails with any bonus tried.
* Init: HF's std 0.02 is too small for hidden 64 (activations shrink ~6x per matrix, attention
  logits ~0). Teacher forcing to loss 0.3 takes 100-230+ steps at 0.02 and 47-80 at std 0.1; with
  std 0.02 the same recipe (dr_grpo, bonus 0.0075) ends at 0.09/0.08 after 400 steps (seeds 1/2):
  entropy stays ~3.4, it does not even settle the answer format.

Proposed recipe, 400 steps, seeds 1/2/3 (single process, 1 torch thread, ~35-45 s each with two
runs sharing 2 busy cores): first-3 0.024/0.014/0.008 -> last-5 0.325/0.369/0.442, best step
0.61/0.50/0.61; reward passes the 0.19 ceiling around step 100-175 and still rises at 400.

Defaults come from configs/digits_grpo.toml; flags override single settings. Prints one line per step
(mean reward, loss, trained tokens/s), then the first-3 / last-3 step mean rewards, and ends with
JSON lines (bench/common.py emit). "Trained tokens" are all tokens of the packed micro-batches the
optimizer stepped on (prompt + completion); tokens/s divides them by the wall time of whole steps
(generate + score + pack + train + weight update), step 0 (warm-up) excluded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looprl.common.v1 import common_pb2
from services.environment_sandbox.environments.base import parse_config
from services.environment_sandbox.environments.datasets import task_by_index
from services.environment_sandbox.environments.digits import DigitsEnv
from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.engine.cpu import CPUEngine
from services.inference_router.engine.scheduler import SchedulerLimits
from services.kit.config.recipe import AlgorithmSection, OptimizerSection, sampling_seed
from services.modeling.config import ModelConfig
from services.modeling.logprobs import token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.modeling.tokenizer import load_tokenizer
from services.rollout_packer.groups import Group
from services.rollout_packer.sequences import Rejected, sequence_from_rollout
from services.rollout_packer.step import PackerSettings, StepBatch, build_step, screen_group
from services.trainer.batch import PackedMicroBatch, validate_rank_batches
from services.trainer.optim import build_optimizer
from services.trainer.step import StepSettings, accumulate, apply_gradients

BENCH = "single_process_grpo"
DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "configs" / "digits_grpo.toml"


@dataclass
class GRPOSettings:
    """Everything one single-process run needs; `from_recipe` fills it from a run recipe."""

    steps: int = 30
    seed: int = 1
    model: dict[str, Any] = field(default_factory=lambda: ModelConfig.tiny().to_dict())
    # A local HF-format directory to start from (wins over `model`/`init_std`), e.g. an SFT warm start.
    model_path: str = ""
    # The run's tokenizer: "char" or a local HF-format directory (with its chat template).
    tokenizer: str = "char"
    # Std of the N(0, std) init of weight matrices (Qwen2ForCausalLM.init_weights); 0.02 is HF's.
    init_std: float = 0.02
    env_config: dict[str, Any] = field(default_factory=lambda: {"min_len": 2, "max_len": 3, "ops": ["rev"]})
    temperature: float = 1.0
    max_tokens: int = 6
    rollouts_per_step: int = 64
    group_size: int = 8
    max_tokens_per_microbatch: int = 2048
    estimator: str = "grpo"
    filter_equal_rewards: bool = False
    aggregation: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    # A bonus that keeps sampling exploratory.
    entropy_coef: float = 0.0
    lr: float = 3e-3
    warmup_steps: int = 2
    schedule: str = "constant"
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    threads: int = 1

    def __post_init__(self) -> None:
        if self.rollouts_per_step % self.group_size:
            raise ValueError(
                f"rollouts_per_step: {self.rollouts_per_step} is not divisible by group_size {self.group_size}"
            )

    @property
    def groups_per_step(self) -> int:
        return self.rollouts_per_step // self.group_size

    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.model)

    @classmethod
    def from_recipe(cls, path: str | Path = DEFAULT_RECIPE, **overrides: Any) -> GRPOSettings:
        """Settings of a run recipe (TOML), with `overrides` on top (model overrides go in `model`)."""
        from services.kit.config.recipe import load_recipe
        from services.modeling.config import model_preset

        r = load_recipe(path)
        if r.environment.name != "digits":
            raise ValueError(f"environment.name: only 'digits' is wired here, got {r.environment.name!r}")
        values: dict[str, Any] = dict(
            steps=r.run.steps,
            seed=r.run.seed,
            model=model_preset(r.model.preset).to_dict(),
            model_path=r.model.path,
            tokenizer=r.model.tokenizer,
            # Read when the recipe has them (see configs/digits_grpo.toml); the fallbacks are the loop's.
            init_std=getattr(r.model, "init_std", 0.02),
            entropy_coef=getattr(r.algorithm, "entropy_coef", 0.0),
            env_config=dict(r.environment.config),
            temperature=r.sampling.temperature,
            max_tokens=r.sampling.max_tokens,
            rollouts_per_step=r.batch.rollouts_per_step,
            group_size=r.batch.group_size,
            max_tokens_per_microbatch=r.batch.max_tokens_per_microbatch,
            estimator=r.algorithm.advantage,
            filter_equal_rewards=r.algorithm.filter_equal_rewards,
            aggregation=r.algorithm.loss_aggregation,
            clip_low=r.algorithm.clip_low,
            clip_high=r.algorithm.clip_high,
            tis_cap=r.algorithm.tis_cap,
            kl_coef=r.algorithm.kl_coef,
            lr=r.optimizer.lr,
            warmup_steps=r.optimizer.warmup_steps,
            schedule=r.optimizer.schedule,
            betas=tuple(r.optimizer.betas),
            weight_decay=r.optimizer.weight_decay,
            grad_clip=r.optimizer.grad_clip,
        )
        model_overrides = overrides.pop("model_overrides", None) or {}
        values.update(overrides)
        values["model"] = {**values["model"], **model_overrides}
        return cls(**values)


@dataclass
class StepRecord:
    step: int
    mean_reward: float
    reward_std: float
    loss: float
    trained_tokens: int
    loss_tokens: int
    seconds: float
    generate_seconds: float
    train_seconds: float
    sync_seconds: float
    clip_fraction: float
    entropy: float
    grad_norm: float
    lr: float
    sample: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.trained_tokens / max(self.seconds, 1e-9)


@dataclass
class Rollout:
    """One scored episode before it becomes a proto (kept for tests and printing)."""

    group_id: str
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    version: int
    reward: float
    text: str


class SingleProcessGRPO:
    """The loop in one process. Use `await run()` or drive `await step()` yourself after `await start()`."""

    def __init__(self, settings: GRPOSettings) -> None:
        self.s = settings
        if settings.threads > 0:  # 0 leaves the process's torch thread count alone
            torch.set_num_threads(settings.threads)
        self.tokenizer = load_tokenizer(settings.tokenizer)
        if settings.model_path:
            self.policy = Qwen2ForCausalLM.from_pretrained(settings.model_path, dtype=torch.float32)
            self.config = self.policy.config
        else:
            self.config = settings.model_config()
            self.policy = Qwen2ForCausalLM(self.config, seed=settings.seed)
            self.policy.init_weights(settings.seed, std=settings.init_std)
        self.reference: Qwen2ForCausalLM | None = None
        if settings.kl_coef > 0:  # the frozen initial policy, as the trainer keeps it
            self.reference = Qwen2ForCausalLM(self.config, seed=None)
            self.reference.load_state_dict(self.policy.state_dict())
            self.reference.requires_grad_(False).eval()
        self.optimizer, self.scheduler = build_optimizer(
            list(self.policy.parameters()),
            OptimizerSection(
                lr=settings.lr,
                betas=list(settings.betas),
                weight_decay=settings.weight_decay,
                warmup_steps=settings.warmup_steps,
                schedule=settings.schedule,
                grad_clip=settings.grad_clip,
            ),
            settings.steps,
        )
        self.loss_cfg = AlgorithmSection(
            advantage=settings.estimator,
            filter_equal_rewards=settings.filter_equal_rewards,
            loss_aggregation=settings.aggregation,
            clip_low=settings.clip_low,
            clip_high=settings.clip_high,
            tis_cap=settings.tis_cap,
            kl_coef=settings.kl_coef,
            entropy_coef=settings.entropy_coef,
        )
        self.packer = PackerSettings(
            prompts_per_step=settings.groups_per_step,
            group_size=settings.group_size,
            estimator=settings.estimator,
            filter_zero_variance=settings.filter_equal_rewards,
            max_tokens_per_microbatch=settings.max_tokens_per_microbatch,
            pad_token_id=self.tokenizer.pad_token_id,
            world_size=1,
        )
        self.env_config = parse_config(DigitsEnv, settings.env_config)
        self.version = 0  # trainer steps taken == weight version the engine serves
        self.engine: CPUEngine | None = None
        self.records: list[StepRecord] = []

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self.engine = CPUEngine.create(
            self.config,
            self._weights(),
            version=0,
            max_batch_size=self.s.rollouts_per_step,
            max_model_len=128,
            limits=SchedulerLimits(default_stop_token_ids=(self.tokenizer.eos_token_id,)),
        ).start()

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()
            self.engine = None

    def _weights(self) -> dict[str, torch.Tensor]:
        # A copy: the engine must keep serving the version it was given while the optimizer moves on.
        return {k: v.detach().clone() for k, v in self.policy.hf_state_dict().items()}

    # ---- generate + score ------------------------------------------------------------------------

    async def rollouts(self, step: int) -> list[Rollout]:
        """Sample and score one step's groups under the engine's current version."""
        assert self.engine is not None, "start() first"
        # The services' tasks and seeds: task step * groups + g, as the gateway publishes them.
        first = step * self.s.groups_per_step
        tasks = [
            task_by_index("digits", first + g, self.s.seed, self.s.env_config)
            for g in range(self.s.groups_per_step)
        ]
        envs_and_prompts = []
        for task in tasks:
            env = DigitsEnv(self.env_config)
            messages = await env.reset(task)
            envs_and_prompts.append((task, self.tokenizer.apply_chat_template(messages)))
        requests = [
            EngineRequest(
                prompt_token_ids=prompt,
                sampling=SamplingParams(
                    temperature=self.s.temperature,
                    max_tokens=self.s.max_tokens,
                    n=self.s.group_size,
                    seed=sampling_seed(self.s.seed, first + g),
                ),
                request_id=f"{step}/{g}",
            )
            for g, (_, prompt) in enumerate(envs_and_prompts)
        ]
        results = await self.engine.generate(requests)
        out: list[Rollout] = []
        for g, ((task, prompt), result) in enumerate(zip(envs_and_prompts, results, strict=True)):
            for i, c in enumerate(result.completions):
                env = DigitsEnv(self.env_config)
                await env.reset(task)
                text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                scored = await env.step(text)
                out.append(
                    Rollout(
                        f"s{step}g{g}",
                        i,
                        prompt,
                        c.token_ids,
                        c.logprobs,
                        c.weight_version,
                        scored.reward,
                        text,
                    )
                )
        return out

    # ---- pack ------------------------------------------------------------------------------------

    def pack(self, step: int, rollouts: list[Rollout]) -> tuple[StepBatch | None, list[Rejected]]:
        """Rollout protos -> validated sequences -> groups -> advantages + pack plan (packer library)."""
        members: dict[str, list] = {}
        rejected: list[Rejected] = []
        for r in rollouts:
            proto = common_pb2.Rollout(
                rollout_id=f"{r.group_id}/{r.sample_index}",
                group_id=r.group_id,
                group_size=self.s.group_size,
                sample_index=r.sample_index,
                reward=r.reward,
                min_weight_version=r.version,
                max_weight_version=r.version,
                turns=[
                    common_pb2.Turn(role=common_pb2.ROLE_USER, token_ids=r.prompt_ids, trainable=False),
                    common_pb2.Turn(
                        role=common_pb2.ROLE_ASSISTANT,
                        token_ids=r.completion_ids,
                        logprobs=r.logprobs,
                        trainable=True,
                        weight_version=r.version,
                    ),
                ],
            )
            seq = sequence_from_rollout(proto, max_tokens=self.s.max_tokens_per_microbatch)
            if isinstance(seq, Rejected):
                rejected.append(seq)
            else:
                members.setdefault(seq.group_id, []).append(seq)
        groups = []
        for gid, seqs in members.items():
            group, drops = screen_group(Group(gid, sorted(seqs, key=lambda s: s.sample_index)), self.packer)
            rejected.extend(drops)
            if group is not None:
                groups.append(group)
        if not groups:
            return None, rejected
        return build_step(step, groups, self.version, self.packer, world_size=1), rejected

    # ---- train -----------------------------------------------------------------------------------

    def micro_batches(self, batch: StepBatch) -> list[PackedMicroBatch]:
        """The step's micro-batches as the trainer receives them, checked like the trainer checks them."""
        micro = [_to_trainer_batch(mb) for mb in batch.micro_batches(0)]
        validate_rank_batches(micro, batch.step, self.config.vocab_size)
        return micro

    @torch.no_grad()
    def policy_logprobs(self, micro: list[PackedMicroBatch]) -> list[torch.Tensor]:
        """Per-token log-probs of the current policy (trainer side), one tensor per micro-batch."""
        self.policy.eval()
        out = []
        for mb in micro:
            logits = self.policy(mb.input_ids, mb.position_ids, mb.cu_seqlens)
            out.append(token_logprobs(logits, mb.input_ids, mb.cu_seqlens, self.s.temperature))
        return out

    def train(self, batch: StepBatch | None) -> dict[str, float]:
        """One optimizer step on the packed micro-batches (what one trainer rank does, without FSDP)."""
        lr = self.scheduler.get_last_lr()[0]
        if batch is None:  # every group was filtered out: the version still advances, like the trainer
            self.scheduler.step()
            self.version += 1
            return {
                "loss": 0.0,
                "trained_tokens": 0,
                "loss_tokens": 0,
                "clip_fraction": 0.0,
                "entropy": 0.0,
                "grad_norm": 0.0,
                "lr": lr,
            }
        if batch.step != self.version:
            raise ValueError(f"batch.step: {batch.step} is not the trainer's next step {self.version}")
        micro = self.micro_batches(batch)
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        # The trainer ranks' own step (services/trainer/step.py), without FSDP.
        step = accumulate(
            self.policy,
            micro,
            StepSettings(self.loss_cfg, self.s.temperature, self.s.max_tokens),
            self.version,
            self.reference,
        )
        grad_norm, _, lr = apply_gradients(self.policy, self.optimizer, self.scheduler, self.s.grad_clip)
        self.version += 1
        m = step.metrics.finalize()
        return {
            "loss": m["loss"],
            "trained_tokens": sum(mb.num_tokens for mb in micro),
            "loss_tokens": int(m["loss_tokens"]),
            "clip_fraction": m["clip_fraction"],
            "entropy": m["entropy"],
            "grad_norm": grad_norm,
            "lr": lr,
        }

    async def sync_weights(self) -> None:
        assert self.engine is not None
        await self.engine.load_weights(self.version, self._weights())

    # ---- the loop --------------------------------------------------------------------------------

    async def step(self) -> StepRecord:
        step = self.version
        t0 = time.perf_counter()
        rollouts = await self.rollouts(step)
        t1 = time.perf_counter()
        batch, _ = self.pack(step, rollouts)
        info = self.train(batch)
        t2 = time.perf_counter()
        await self.sync_weights()
        t3 = time.perf_counter()
        rewards = np.array([r.reward for r in rollouts])
        record = StepRecord(
            step=step,
            mean_reward=float(rewards.mean()),
            reward_std=float(rewards.std()),
            loss=info["loss"],
            trained_tokens=int(info["trained_tokens"]),
            loss_tokens=int(info["loss_tokens"]),
            seconds=t3 - t0,
            generate_seconds=t1 - t0,
            train_seconds=t2 - t1,
            sync_seconds=t3 - t2,
            clip_fraction=info["clip_fraction"],
            entropy=info["entropy"],
            grad_norm=info["grad_norm"],
            lr=info["lr"],
            sample=f"{self.tokenizer.decode(rollouts[0].prompt_ids)!r} -> {rollouts[0].text!r}",
        )
        self.records.append(record)
        return record

    async def run(self, steps: int | None = None, log: Any = None) -> list[StepRecord]:
        await self.start()
        try:
            for _ in range(steps if steps is not None else self.s.steps):
                record = await self.step()
                if log is not None:
                    log(record)
        finally:
            await self.close()
        return self.records


def _to_trainer_batch(mb: Any) -> PackedMicroBatch:
    """The packer's numpy micro-batch as the trainer's torch one (what NextBatch + from_proto yield)."""
    t = mb.to_torch()
    return PackedMicroBatch(
        step=mb.step,
        input_ids=t["input_ids"].long(),
        position_ids=t["position_ids"].long(),
        cu_seqlens=t["cu_seqlens"].long(),
        loss_mask=t["loss_mask"].float(),
        advantages=t["advantages"].float(),
        behaviour_logprobs=t["behaviour_logprobs"].float(),
        versions=t["versions"].long(),
        global_loss_tokens=mb.global_loss_tokens,
        global_sequences=mb.global_sequences,
        rank=mb.rank,
        index=mb.index,
        count=mb.count,
        rollout_ids=list(mb.rollout_ids),
    )


def run_sync(settings: GRPOSettings, steps: int | None = None, log: Any = None) -> list[StepRecord]:
    """Run the loop to completion from synchronous code."""
    return asyncio.run(SingleProcessGRPO(settings).run(steps, log))


def summarize(records: list[StepRecord], k: int = 3) -> dict[str, float]:
    rewards = [r.mean_reward for r in records]
    timed = records[1:] if len(records) > 1 else records  # step 0 pays for first-touch warm-up
    seconds = sum(r.seconds for r in timed)
    return {
        "first_reward": float(np.mean(rewards[:k])),
        "last_reward": float(np.mean(rewards[-k:])),
        "best_reward": float(max(rewards)),
        "steps": len(records),
        "wall_seconds": float(sum(r.seconds for r in records)),
        "trained_tokens_per_s": sum(r.trained_tokens for r in timed) / max(seconds, 1e-9),
        "loss_tokens_per_s": sum(r.loss_tokens for r in timed) / max(seconds, 1e-9),
        "steps_per_s": len(timed) / max(seconds, 1e-9),
    }


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer steps (8), for a smoke run")
    p.add_argument("--recipe", default=str(DEFAULT_RECIPE))
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=int, dest="warmup_steps")
    p.add_argument("--schedule", choices=("constant", "cosine"))
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--rollouts", type=int, dest="rollouts_per_step")
    p.add_argument("--group-size", type=int)
    p.add_argument("--clip-low", type=float)
    p.add_argument("--clip-high", type=float)
    p.add_argument("--estimator", choices=("grpo", "dr_grpo", "rloo"))
    p.add_argument("--aggregation", choices=("token-mean", "seq-mean-token-mean", "constant"))
    p.add_argument("--filter-equal", action="store_true", dest="filter_equal_rewards", default=None)
    p.add_argument("--kl-coef", type=float)
    p.add_argument("--entropy-coef", type=float)
    p.add_argument("--model-path", help="start from this local HF-format directory")
    p.add_argument("--init-std", type=float)
    p.add_argument("--grad-clip", type=float)
    p.add_argument("--env", type=json.loads, dest="env_config", help='JSON, e.g. {"ops": ["copy"]}')
    p.add_argument("--model", type=json.loads, dest="model_overrides", help='JSON, e.g. {"hidden_size": 128}')
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    return p.parse_args()


def main() -> None:
    args = _parse_args()
    keys = {f for f in GRPOSettings.__dataclass_fields__} | {"model_overrides"}
    overrides = {k: v for k, v in vars(args).items() if k in keys and v is not None}
    if args.quick and args.steps is None:
        overrides["steps"] = 8
    settings = GRPOSettings.from_recipe(args.recipe, **overrides)
    print(f"settings: {json.dumps(asdict(settings))}", flush=True)
    print(
        f"{'step':>4} {'reward':>7} {'std':>6} {'loss':>8} {'clip':>5} {'ent':>5} {'gnorm':>6} {'tok/s':>8} "
        f"{'gen s':>6} {'train s':>7}  sample"
    )

    def log(r: StepRecord) -> None:
        if not args.quiet:
            print(
                f"{r.step:>4} {r.mean_reward:>7.3f} {r.reward_std:>6.3f} {r.loss:>8.4f} {r.clip_fraction:>5.2f} {r.entropy:>5.2f} "
                f"{r.grad_norm:>6.2f} {r.tokens_per_s:>8.0f} {r.generate_seconds:>6.2f} {r.train_seconds:>7.2f}"
                f"  {r.sample}",
                flush=True,
            )

    records = run_sync(settings, log=log)
    s = summarize(records)
    first = ", ".join(f"{r.mean_reward:.3f}" for r in records[:3])
    last = ", ".join(f"{r.mean_reward:.3f}" for r in records[-3:])
    print(f"first-3 step mean rewards: {first} (mean {s['first_reward']:.3f})")
    print(f"last-3 step mean rewards:  {last} (mean {s['last_reward']:.3f})")
    print(
        f"{s['steps']} steps in {s['wall_seconds']:.1f} s; trained tokens/s {s['trained_tokens_per_s']:.0f} "
        f"(loss tokens/s {s['loss_tokens_per_s']:.0f}, steps/s {s['steps_per_s']:.2f}, step 0 excluded)"
    )
    from bench.common import emit

    emit(BENCH, "trained_tokens_per_s", s["trained_tokens_per_s"], None, None, "tokens/s", "baseline")
    emit(
        BENCH,
        "reward_gain",
        s["last_reward"] - s["first_reward"],
        None,
        None,
        "reward",
        "last-3 minus first-3 step mean reward > 0.05",
    )


if __name__ == "__main__":
    main()
