"""Checks of a run report's grid figure against the run's own records (GetRun's history and weight
deliveries), read back from the drawn matplotlib artists rather than from the report's data."""

from __future__ import annotations

import numpy as np

from looprl.gateway.v1 import gateway_pb2

# Panel title -> the StepSummary fields its lines draw, in order.
PER_STEP_PANELS = {
    "loss": ["loss"],
    "entropy": ["entropy"],
    "KL to reference": ["kl"],
    "clip fraction": ["clip_fraction"],
    "response length": ["mean_response_tokens"],
    "trained tokens/s": ["train_tokens_per_second"],
    "staleness": ["mean_staleness", "max_staleness"],
    "importance ratio (trainer / sampler)": [
        "importance_ratio_mean",
        "importance_ratio_max",
        "importance_ratio_min",
        "importance_ratio_clipped",
    ],
    "groups resampled": ["resampled_groups"],
}
SYNC_PANEL = "weight-sync seconds per version"
ALL_PANELS = {"reward", *PER_STEP_PANELS, SYNC_PANEL}


def _lines(ax) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)) for line in ax.lines]


def assert_grid_matches_records(fig, run: gateway_pb2.Run) -> None:
    """Every panel is there, and every point drawn is a record of the run (and every record drawn)."""
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    assert set(axes) == ALL_PANELS, f"panels drawn: {sorted(axes)}"
    steps = np.array([h.step for h in run.history], float)
    assert len(steps) > 0

    reward = axes["reward"]
    ((x, y),) = _lines(reward)
    np.testing.assert_allclose(x, steps)
    np.testing.assert_allclose(y, [h.reward_mean for h in run.history])
    # The band's outline holds mean - std and mean + std at every step.
    (band,) = reward.collections
    outline = {(round(px, 9), round(py, 9)) for px, py in band.get_paths()[0].vertices}
    for h in run.history:
        for edge in (h.reward_mean - h.reward_std, h.reward_mean + h.reward_std):
            assert (round(float(h.step), 9), round(edge, 9)) in outline, f"step {h.step}: band misses {edge}"

    for title, fields in PER_STEP_PANELS.items():
        drawn = _lines(axes[title])
        assert len(drawn) == len(fields), f"{title}: {len(drawn)} lines for {fields}"
        for (x, y), field in zip(drawn, fields, strict=True):
            np.testing.assert_allclose(x, steps, err_msg=f"{title}: steps")
            np.testing.assert_allclose(
                y, [getattr(h, field) for h in run.history], err_msg=f"{title}: {field}"
            )

    by_deployment: dict[str, list[gateway_pb2.WeightSync]] = {}
    for w in run.weight_syncs:
        by_deployment.setdefault(w.deployment, []).append(w)
    sync_axes = axes[SYNC_PANEL]
    drawn = _lines(sync_axes)
    labels = [line.get_label() for line in sync_axes.lines]
    assert sorted(labels) == sorted(by_deployment), f"weight-sync lines {labels} vs {sorted(by_deployment)}"
    for label, (x, y) in zip(labels, drawn, strict=True):
        ws = sorted(by_deployment[label], key=lambda w: w.version)
        np.testing.assert_allclose(x, [w.version for w in ws])
        np.testing.assert_allclose(y, [w.sync_seconds for w in ws])
