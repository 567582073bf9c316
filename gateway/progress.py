"""Following a run: the live progress line and the reward gain (the report is gateway/report.py)."""

from __future__ import annotations

import statistics

from looprl.gateway.v1 import gateway_pb2

STATE_NAMES = {v: k.removeprefix("RUN_STATE_").lower() for k, v in gateway_pb2.RunState.items()}


def progress_line(run: gateway_pb2.Run) -> str:
    """One line per update: step, reward, throughput, staleness, versions, queues; for a queued run
    its place in the run queue and what it waits for."""
    last = run.history[-1] if run.history else None
    parts = [f"[{STATE_NAMES.get(run.state, '?'):>9}] step {run.step:>3}/{run.total_steps}"]
    if run.state == gateway_pb2.RUN_STATE_QUEUED:
        parts.append(f"queue position {run.queue_position}: waits for {run.queued_reason}")
        return " | ".join(parts)
    if last is not None:
        parts += [
            f"reward {last.reward_mean:6.3f} ±{last.reward_std:5.3f}",
            f"loss {last.loss:+.4f}",
            f"train {last.train_tokens_per_second:7.0f} tok/s",
            f"staleness {last.mean_staleness:.2f}",
        ]
    if run.evaluations:
        ev = run.evaluations[-1]
        parts.append(
            f"eval@{ev.step} pass@1 {ev.pass_at_1:.3f}" + (f" pass@{ev.k} {ev.pass_at_k:.3f}" if ev.k else "")
        )
    versions = " ".join(f"{d.deployment}=v{d.version}" for d in run.deployments)
    parts.append(f"trainer v{run.weight_version}" + (f" | {versions}" if versions else ""))
    parts.append(f"episodes {run.episodes_published} trained {run.rollouts_trained}")
    if run.dataset.filtered_too_long:
        parts.append(f"prompts too long {run.dataset.filtered_too_long}")
    if run.rollouts_dropped:
        parts.append("dropped " + ",".join(f"{k}={v}" for k, v in run.rollouts_dropped.items()))
    if run.duplicate_deliveries:
        parts.append(f"duplicates {run.duplicate_deliveries}")
    if run.step_records_ignored:
        parts.append(f"ignored step records {run.step_records_ignored}")
    if run.stalled_reason:
        parts.append(f"stalled: {run.stalled_reason}")
    elif (
        run.last_error.component
        and run.state != gateway_pb2.RUN_STATE_COMPLETED
        and (last is None or run.last_error.unix_time >= last.unix_time)
    ):  # an error the run has trained past is history, not news
        parts.append(f"last error {run.last_error.component}: {run.last_error.message[:200]}")
    if run.error:
        parts.append(f"error: {run.error}")
    return " | ".join(parts)


def reward_gain(run: gateway_pb2.Run, window: int = 3) -> tuple[float, float]:
    """Mean reward of the first and of the last `window` steps."""
    rewards = [h.reward_mean for h in run.history]
    if not rewards:
        return 0.0, 0.0
    window = max(1, min(window, len(rewards) // 2 or 1))
    return statistics.fmean(rewards[:window]), statistics.fmean(rewards[-window:])
