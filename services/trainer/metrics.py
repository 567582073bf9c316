"""Prometheus metrics of the trainer, labelled by run (names: services/kit/telemetry/metrics.py).

Set by the training loop in the trainer process from rank 0's all-reduced step results; the
ranks themselves (Ray actors) export nothing."""

from __future__ import annotations

import contextlib
from typing import Any

from services.kit.telemetry.metrics import counter, gauge, histogram, observe

LOSS = gauge("looprl_trainer_loss")
KL = gauge("looprl_trainer_kl")
ENTROPY = gauge("looprl_trainer_entropy")
GRAD_NORM = gauge("looprl_trainer_grad_norm")
CLIP_FRACTION = gauge("looprl_trainer_clip_fraction")
IMPORTANCE_RATIO = gauge("looprl_trainer_importance_ratio")
REWARD_MEAN = gauge("looprl_trainer_reward_mean")
STALENESS = gauge("looprl_trainer_staleness_steps")
TOKENS_PER_SECOND = gauge("looprl_trainer_tokens_per_second")
WEIGHT_VERSION = gauge("looprl_trainer_weight_version")
STEPS = counter("looprl_trainer_steps_total")
TOKENS = counter("looprl_trainer_tokens_total")
STEP_SECONDS = histogram("looprl_trainer_step_seconds")
CHECKPOINT_SECONDS = histogram("looprl_trainer_checkpoint_seconds")

PHASES = ("pull", "train", "push", "step")
CHECKPOINT_KINDS = ("checkpoint", "hf_export")
# stat label of IMPORTANCE_RATIO -> the step result's key.
RATIO_STATS = {"mean": "ratio", "max": "ratio_max", "min": "ratio_min", "clipped": "ratio_clipped"}


def init_run(run_id: str) -> None:
    """The run's counters and histograms at zero, before its first step."""
    STEPS.labels(run_id)
    TOKENS.labels(run_id)
    for phase in PHASES:
        STEP_SECONDS.labels(run_id, phase)
    for kind in CHECKPOINT_KINDS:
        CHECKPOINT_SECONDS.labels(run_id, kind)


def record_step(run_id: str, m: dict[str, Any], step_seconds: float) -> None:
    """One trained step: its loss statistics, throughput and where its time went."""
    LOSS.labels(run_id).set(m["loss"])
    KL.labels(run_id).set(m["kl"])
    ENTROPY.labels(run_id).set(m["entropy"])
    GRAD_NORM.labels(run_id).set(m["grad_norm"])
    CLIP_FRACTION.labels(run_id).set(m["clip_fraction"])
    for stat, key in RATIO_STATS.items():
        IMPORTANCE_RATIO.labels(run_id, stat).set(m.get(key, 0.0))
    REWARD_MEAN.labels(run_id).set(m.get("reward_mean", 0.0))
    STALENESS.labels(run_id, "mean").set(m["staleness"])
    STALENESS.labels(run_id, "max").set(m["max_staleness"])
    TOKENS_PER_SECOND.labels(run_id).set(m["tokens_per_second"])
    WEIGHT_VERSION.labels(run_id).set(m["version"])
    STEPS.labels(run_id).inc()
    TOKENS.labels(run_id).inc(m["num_tokens"])
    for phase, seconds in (m.get("phase_seconds") or {}).items():
        observe(STEP_SECONDS.labels(run_id, phase), seconds)
    observe(STEP_SECONDS.labels(run_id, "step"), step_seconds)


def forget_run(run_id: str) -> None:
    """Drop the run's series once the trainer forgets the run: a trainer that serves runs for weeks
    would otherwise export every run it ever trained."""
    series = [
        *((m, ()) for m in (LOSS, KL, ENTROPY, GRAD_NORM, CLIP_FRACTION, REWARD_MEAN, TOKENS_PER_SECOND)),
        *((m, ()) for m in (WEIGHT_VERSION, STEPS, TOKENS)),
        *((STALENESS, (kind,)) for kind in ("mean", "max")),
        *((IMPORTANCE_RATIO, (stat,)) for stat in RATIO_STATS),
        *((STEP_SECONDS, (phase,)) for phase in PHASES),
        *((CHECKPOINT_SECONDS, (kind,)) for kind in CHECKPOINT_KINDS),
    ]
    for metric, rest in series:
        with contextlib.suppress(KeyError):  # a series the run never set
            metric.remove(run_id, *rest)
