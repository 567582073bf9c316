"""The packed, micro-batched policy loss equals a naive per-sequence reference, and splitting a step
into micro-batches (and ranks) changes neither the loss nor its gradient."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from trainer_reference import reference_clip_fraction, reference_step_loss

from services.kit.config.recipe import AlgorithmSection, RecipeError, parse_recipe
from services.trainer.loss import LossMetrics, StepNorm, policy_loss


def _make_step(seed: int, num_seqs: int = 6):
    gen = torch.Generator().manual_seed(seed)
    sequences = []
    for _ in range(num_seqs):
        length = int(torch.randint(3, 12, (1,), generator=gen))
        prompt = int(torch.randint(1, length - 1, (1,), generator=gen))
        mask = [0] * prompt + [1] * (length - prompt)
        adv_value = float(torch.randn(1, generator=gen))
        sequences.append(
            {
                "mask": mask,
                "adv": [adv_value * m for m in mask],
                # Behaviour log-probs near the current ones, some far off (stale) to hit clip and TIS.
                "behaviour": [0.0] * length,
                "ref": [float(-1.5 + 0.3 * torch.randn(1, generator=gen)) for _ in range(length)],
                "entropy": torch.rand(length, generator=gen, dtype=torch.float64),
            }
        )
    params = [torch.randn(len(s["mask"]), generator=gen, dtype=torch.float64) * 0.5 - 1.5 for s in sequences]
    for seq, p in zip(sequences, params, strict=True):
        noise = torch.randn(len(seq["mask"]), generator=gen, dtype=torch.float64) * 0.6
        seq["behaviour"] = [float(v) * m for v, m in zip(p + noise, seq["mask"], strict=True)]
    return sequences, params


def _packed(sequences, params, lo: int, hi: int):
    seqs, ps = sequences[lo:hi], params[lo:hi]
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s["mask"]))
    cat = lambda key: torch.tensor([v for s in seqs for v in s[key]], dtype=torch.float64)  # noqa: E731
    return {
        "logprobs": torch.cat(ps),
        "behaviour_logprobs": cat("behaviour"),
        "advantages": cat("adv"),
        "loss_mask": cat("mask"),
        "ref_logprobs": cat("ref"),
        "entropy": torch.cat([s["entropy"] for s in seqs]),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
    }


# The recipe's [algorithm] section as the loss takes it; Dr. GRPO's normaliser (max_tokens) goes in StepNorm.
MAX_TOKENS = 16
CONFIGS = [
    AlgorithmSection(loss_aggregation="token-mean", kl_coef=0.0, tis_cap=2.0),
    AlgorithmSection(loss_aggregation="token-mean", kl_coef=0.05, entropy_coef=0.01, tis_cap=1.5),
    AlgorithmSection(
        loss_aggregation="seq-mean-token-mean", clip_low=0.1, clip_high=0.3, tis_cap=0.0, kl_coef=0.1
    ),
    AlgorithmSection(loss_aggregation="constant", tis_cap=3.0),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss_aggregation}-kl{c.kl_coef}-tis{c.tis_cap}")
@pytest.mark.parametrize("splits", [[0, 6], [0, 2, 6], [0, 1, 3, 4, 6]])
def test_micro_batched_loss_and_grad_match_naive_reference(cfg: AlgorithmSection, splits: list[int]) -> None:
    sequences, base = _make_step(seed=7)
    ref_params = [p.clone().requires_grad_(True) for p in base]
    ref_loss = reference_step_loss(
        sequences,
        cfg.clip_low,
        cfg.clip_high,
        cfg.tis_cap,
        cfg.kl_coef,
        cfg.entropy_coef,
        cfg.loss_aggregation,
        MAX_TOKENS,
        logprob_fn=lambda i: ref_params[i],
    )
    ref_loss.backward()

    params = [p.clone().requires_grad_(True) for p in base]
    norm = StepNorm(
        global_loss_tokens=sum(sum(s["mask"]) for s in sequences),
        global_sequences=len(sequences),
        max_tokens=MAX_TOKENS,
    )
    total = LossMetrics()
    for lo, hi in itertools.pairwise(splits):
        mb = _packed(sequences, params, lo, hi)
        share, metrics = policy_loss(
            mb["logprobs"],
            mb["behaviour_logprobs"],
            mb["advantages"],
            mb["loss_mask"],
            mb["cu_seqlens"],
            cfg,
            norm,
            ref_logprobs=mb["ref_logprobs"] if cfg.kl_coef > 0 else None,
            entropy=mb["entropy"] if cfg.entropy_coef > 0 else None,
        )
        share.backward()
        total.add(metrics)
    result = total.finalize()

    assert math.isclose(result["loss"], float(ref_loss.detach()), rel_tol=1e-9, abs_tol=1e-12)
    for mine, theirs in zip(params, ref_params, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-9, atol=1e-12)
    expected_clip = reference_clip_fraction(sequences, base, cfg.clip_low, cfg.clip_high)
    assert math.isclose(result["clip_fraction"], expected_clip, rel_tol=1e-9)
    assert result["loss_tokens"] == norm.global_loss_tokens


def test_some_tokens_are_clipped_and_truncated_in_the_fixture() -> None:
    """The fixture must exercise the clip and TIS branches, or the equality above proves little."""
    sequences, base = _make_step(seed=7)
    cfg = CONFIGS[0]
    mb = _packed(sequences, base, 0, len(sequences))
    norm = StepNorm(int(mb["loss_mask"].sum()), len(sequences))
    _, metrics = policy_loss(
        mb["logprobs"],
        mb["behaviour_logprobs"],
        mb["advantages"],
        mb["loss_mask"],
        mb["cu_seqlens"],
        cfg,
        norm,
    )
    assert 0 < metrics["clip_fraction"] < metrics["tokens"]
    assert 0 < metrics["tis_fraction"] < metrics["tokens"]


def test_on_policy_ratio_is_one_and_gradient_is_advantage_weighted() -> None:
    """On-policy data (behaviour == current): ratio 1, nothing clipped, grad = -A/N per token."""
    logp = torch.tensor([0.0, -1.0, -2.0, 0.0, -0.5], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([0, 1, 1, 0, 1.0], dtype=torch.float64)
    adv = torch.tensor([0, 2.0, 2.0, 0, -1.0], dtype=torch.float64)
    cu = torch.tensor([0, 3, 5])
    share, metrics = policy_loss(
        logp,
        logp.detach(),
        adv,
        mask,
        cu,
        AlgorithmSection(),
        StepNorm(global_loss_tokens=3, global_sequences=2),
    )
    share.backward()
    assert metrics["ratio"] == pytest.approx(3.0) and metrics["clip_fraction"] == 0
    torch.testing.assert_close(logp.grad, -adv * mask / 3)


def test_stale_token_with_negative_advantage_has_bounded_gradient() -> None:
    """PPO's min keeps r*A unbounded for A<0; TIS caps the gradient weight at tis_cap."""
    logp = torch.tensor([0.0, -0.1], dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor([0.0, -6.0], dtype=torch.float64)  # r = e^5.9 ~ 365
    adv = torch.tensor([0.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([0.0, 1.0], dtype=torch.float64)
    share, _ = policy_loss(
        logp, behaviour, adv, mask, torch.tensor([0, 2]), AlgorithmSection(tis_cap=2.0), StepNorm(1, 1)
    )
    share.backward()
    assert float(logp.grad[1]) == pytest.approx(2.0)


def test_bad_aggregation_is_named() -> None:
    """The recipe rejects it (the loss takes the recipe's section as is)."""
    with pytest.raises(RecipeError, match=r"algorithm\.loss_aggregation"):
        parse_recipe('[algorithm]\nloss_aggregation = "mean"\n')


def test_importance_ratio_statistics_of_a_step_do_not_depend_on_its_micro_batches() -> None:
    """The sampler/trainer importance ratio's mean, max, min and share outside the clip range, over a
    step split into micro-batches, are those of the step's trained tokens taken together."""
    sequences, base = _make_step(seed=11, num_seqs=8)
    cfg = CONFIGS[0]
    whole = _packed(sequences, base, 0, len(sequences))
    trained = whole["loss_mask"] > 0
    ratio = torch.exp(whole["logprobs"] - whole["behaviour_logprobs"])[trained]
    outside = (ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high)
    assert 0 < int(outside.sum()) < ratio.numel()  # the fixture has tokens on both sides

    norm = StepNorm(int(trained.sum()), len(sequences))
    total = LossMetrics()
    for lo, hi in ((0, 3), (3, 4), (4, 8)):
        mb = _packed(sequences, base, lo, hi)
        _, metrics = policy_loss(
            mb["logprobs"],
            mb["behaviour_logprobs"],
            mb["advantages"],
            mb["loss_mask"],
            mb["cu_seqlens"],
            cfg,
            norm,
        )
        total.add(metrics)
    # Across ranks the sums travel through a SUM all-reduce and the extremes through a MAX one.
    result = LossMetrics.from_tensor(total.as_tensor()).finalize(total.maxima_tensor())
    assert result["ratio"] == pytest.approx(float(ratio.mean()))
    assert result["ratio_max"] == pytest.approx(float(ratio.max()))
    assert result["ratio_min"] == pytest.approx(float(ratio.min()))
    assert result["ratio_clipped"] == pytest.approx(float(outside.double().mean()))
    assert total.finalize() == result
