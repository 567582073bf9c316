"""Helpers for the trainer's rank tests: deterministic packed steps and a single-process reference
trainer (plain unsharded model, naive per-sequence loss, torch AdamW)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from services.kit.config.recipe import AlgorithmSection, OptimizerSection, Recipe, RunSection
from services.modeling.config import ModelConfig
from services.modeling.logprobs import token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.trainer.batch import PackedMicroBatch, to_proto
from services.trainer.spec import TrainerSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "trainer"))
from trainer_reference import reference_step_loss

MODEL = ModelConfig.tiny(hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8)


def make_spec(**algorithm_overrides) -> TrainerSpec:
    recipe = Recipe(
        run=RunSection(seed=3, steps=8),
        algorithm=AlgorithmSection(
            **{"clip_low": 0.2, "clip_high": 0.28, "tis_cap": 2.0, **algorithm_overrides}
        ),
        # eps 1e-6: Adam's first step is ~lr*sign(g), so grads at float-noise level would make
        # reference comparisons flaky with a smaller eps.
        optimizer=OptimizerSection(lr=1e-2, eps=1e-6, grad_clip=1.0, warmup_steps=1, schedule="cosine"),
    )
    return TrainerSpec(recipe=recipe, architecture=MODEL.to_dict())


@dataclass
class Sequence:
    tokens: list[int]
    mask: list[int]
    adv: list[float]
    behaviour: list[float]
    version: int


def make_sequences(seed: int, count: int, step: int, model: Qwen2ForCausalLM | None = None) -> list[Sequence]:
    """Heterogeneous sequences with prompt + completion; behaviour log-probs are the model's own
    (when given) plus noise, so ratios spread around 1 and some tokens clip."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        length = int(torch.randint(4, 14, (1,), generator=gen))
        prompt = int(torch.randint(1, 3, (1,), generator=gen))
        tokens = torch.randint(0, MODEL.vocab_size, (length,), generator=gen)
        mask = [0] * prompt + [1] * (length - prompt)
        adv = float(torch.randn(1, generator=gen))
        if model is not None:
            with torch.no_grad():
                cu = torch.tensor([0, length])
                logp = token_logprobs(model(tokens, torch.arange(length), cu), tokens, cu)
        else:
            logp = -torch.rand(length, generator=gen) * 4
        noisy = (logp + 0.2 * torch.randn(length, generator=gen)).clamp(max=0.0)
        out.append(
            Sequence(
                tokens=tokens.tolist(),
                mask=mask,
                adv=[adv * m for m in mask],
                behaviour=[float(v) * m for v, m in zip(noisy, mask, strict=True)],
                version=max(step - int(torch.randint(0, 2, (1,), generator=gen)), 0),
            )
        )
    return out


def pack(seqs: list[Sequence], step: int, global_loss_tokens: int, global_sequences: int, index=0, count=1):
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s.tokens))
    return PackedMicroBatch(
        step=step,
        input_ids=torch.tensor([t for s in seqs for t in s.tokens]),
        position_ids=torch.cat([torch.arange(len(s.tokens)) for s in seqs]),
        cu_seqlens=torch.tensor(cu),
        loss_mask=torch.tensor([float(m) for s in seqs for m in s.mask]),
        advantages=torch.tensor([a for s in seqs for a in s.adv]),
        behaviour_logprobs=torch.tensor([b for s in seqs for b in s.behaviour]),
        versions=torch.tensor([s.version for s in seqs for _ in s.tokens]),
        global_loss_tokens=global_loss_tokens,
        global_sequences=global_sequences,
        index=index,
        count=count,
        rollout_ids=[f"r{step}-{index}-{i}" for i in range(len(seqs))],
    )


def make_step(step: int, world_size: int, micro_per_rank: int, seqs_per_micro: int, seed: int, model=None):
    """(per-rank lists of MicroBatch bytes, all sequences in order) for one trainer step."""
    n = world_size * micro_per_rank * seqs_per_micro
    seqs = make_sequences(seed, n, step, model)
    global_tokens = sum(sum(s.mask) for s in seqs)
    per_rank = []
    for rank in range(world_size):
        batches = []
        for i in range(micro_per_rank):
            lo = (rank * micro_per_rank + i) * seqs_per_micro
            mb = pack(seqs[lo : lo + seqs_per_micro], step, global_tokens, n, index=i, count=micro_per_rank)
            mb.rank = rank
            batches.append(to_proto(mb).SerializeToString())
        per_rank.append(batches)
    return per_rank, seqs


class ReferenceTrainer:
    """The same training step done the obvious way in one process, for comparison."""

    def __init__(self, spec: TrainerSpec) -> None:
        self.spec = spec
        self.model = Qwen2ForCausalLM(spec.model_config(), seed=spec.recipe.run.seed)
        opt = spec.recipe.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=opt.lr,
            betas=tuple(opt.betas),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        from services.trainer.optim import LrSchedule

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, LrSchedule(opt.warmup_steps, opt.schedule, spec.total_steps)
        )

    def logprobs_alone(self, seq: Sequence) -> torch.Tensor:
        tokens = torch.tensor(seq.tokens)
        cu = torch.tensor([0, len(seq.tokens)])
        return token_logprobs(self.model(tokens, torch.arange(len(seq.tokens)), cu), tokens, cu)

    def loss(self, seqs: list[Sequence]) -> torch.Tensor:
        c = self.spec.recipe.algorithm
        as_dicts = [{"mask": s.mask, "adv": s.adv, "behaviour": s.behaviour} for s in seqs]
        return reference_step_loss(
            as_dicts,
            c.clip_low,
            c.clip_high,
            c.tis_cap,
            c.kl_coef,
            c.entropy_coef,
            c.loss_aggregation,
            self.spec.loss_max_tokens,
            logprob_fn=lambda i: self.logprobs_alone(seqs[i]),
        )

    def step(self, seqs: list[Sequence]) -> float:
        self.optimizer.zero_grad()
        loss = self.loss(seqs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.recipe.optimizer.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return float(loss.detach())
