"""Following a run: the live progress line and the end-of-run report (reward plot + summary)."""

from __future__ import annotations

import statistics
from pathlib import Path

from looprl.gateway.v1 import gateway_pb2

STATE_NAMES = {v: k.removeprefix("RUN_STATE_").lower() for k, v in gateway_pb2.RunState.items()}


def progress_line(run: gateway_pb2.Run) -> str:
    """One line per update: step, reward, throughput, staleness, versions, queues."""
    last = run.history[-1] if run.history else None
    parts = [f"[{STATE_NAMES.get(run.state, '?'):>9}] step {run.step:>3}/{run.total_steps}"]
    if last is not None:
        parts += [
            f"reward {last.reward_mean:6.3f} ±{last.reward_std:5.3f}",
            f"loss {last.loss:+.4f}",
            f"train {last.train_tokens_per_second:7.0f} tok/s",
            f"staleness {last.mean_staleness:.2f}",
        ]
    versions = " ".join(f"{d.deployment}=v{d.version}" for d in run.deployments)
    parts.append(f"trainer v{run.weight_version}" + (f" | {versions}" if versions else ""))
    parts.append(f"episodes {run.episodes_published} trained {run.rollouts_trained}")
    if run.rollouts_dropped:
        parts.append("dropped " + ",".join(f"{k}={v}" for k, v in run.rollouts_dropped.items()))
    if run.duplicate_deliveries:
        parts.append(f"duplicates {run.duplicate_deliveries}")
    if run.stalled_reason:
        parts.append(f"stalled: {run.stalled_reason}")
    elif run.last_error.component and run.state != gateway_pb2.RUN_STATE_COMPLETED:
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


def write_report(run: gateway_pb2.Run, out_dir: Path) -> Path:
    """reward.png (reward vs step with spread) and summary.md; returns the summary path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [h.step for h in run.history]
    means = [h.reward_mean for h in run.history]
    stds = [h.reward_std for h in run.history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, means, marker="o", label="mean reward")
    ax.fill_between(
        steps,
        [m - s for m, s in zip(means, stds, strict=True)],
        [m + s for m, s in zip(means, stds, strict=True)],
        alpha=0.2,
        label="± std",
    )
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward")
    ax.set_title(f"{run.run_id}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "reward.png", dpi=110)
    plt.close(fig)
    first, last = reward_gain(run)
    lines = [
        f"# Run {run.run_id}",
        "",
        f"- state: {STATE_NAMES.get(run.state, '?')}",
        f"- steps: {run.step}/{run.total_steps}, trainer weight version {run.weight_version}",
        f"- reward: first steps {first:.3f} -> last steps {last:.3f} ({last - first:+.3f})",
        f"- episodes published {run.episodes_published}, rollouts trained {run.rollouts_trained}",
        f"- dropped: {dict(run.rollouts_dropped) or 'none'}; redelivered duplicates recognised: {run.duplicate_deliveries}",
        f"- deployments: {', '.join(f'{d.deployment}=v{d.version}' for d in run.deployments) or 'n/a'}",
        "",
        "| step | reward mean | reward std | loss | staleness | train tok/s | rollouts | seconds |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for h in run.history:
        lines.append(
            f"| {h.step} | {h.reward_mean:.3f} | {h.reward_std:.3f} | {h.loss:+.4f} | {h.mean_staleness:.2f} | "
            f"{h.train_tokens_per_second:.0f} | {h.num_rollouts} | {h.seconds:.1f} |"
        )
    summary = out_dir / "summary.md"
    summary.write_text("\n".join(lines) + "\n")
    return summary
