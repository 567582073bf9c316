"""The end-of-run report: one grid image of what RL practitioners watch, a condensed summary table,
the full per-step history as CSV and the sample completions, all drawn from the run as GetRun
returns it.

Panels: reward with its spread, loss, entropy, KL, clip fraction, response length, trained
tokens/s, staleness, the sampler/trainer importance ratio, groups resampled per step, and
weight-sync seconds per version (one line per deployment). Each panel is a list of `Series`
computed from the run's records (`panels`), each naming the scalar it draws (`scalars`: every
number of the run's history, which the loggers of gateway/run_logs.py write), so what is drawn can
be checked against the records and against what was logged.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor

from gateway.progress import STATE_NAMES, reward_gain
from looprl.gateway.v1 import gateway_pb2

# Rows the summary table aims at: every k-th step, k chosen so the table holds about this many.
TABLE_ROWS = 40
# The last steps, always in the table whatever k is.
TABLE_TAIL = 5

GRID_IMAGE = "report.png"
SUMMARY = "summary.md"
HISTORY_CSV = "history.csv"
SAMPLES = "samples.md"

# StepSummary fields that are not scalars of the step.
NOT_SCALARS = frozenset({"step", "unix_time"})
# A samples table's columns: (header, SampleCompletion field, format).
SAMPLE_COLUMNS = (
    ("prompt", "prompt", "{}"),
    ("completion", "completion", "{}"),
    ("reward", "reward", "{:.3f}"),
    ("advantage", "advantage", "{:+.3f}"),
    ("length", "response_tokens", "{:d}"),
    ("version", "weight_version", "{:d}"),
)


def history_tag(field: str) -> str:
    """The logged name of a StepSummary field."""
    return f"train/{field}"


def sync_tag(deployment: str) -> str:
    """The logged name of a deployment's weight-sync seconds (stepped by weight version)."""
    return f"weight_sync/{deployment}/seconds"


def scalars(run: gateway_pb2.Run) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run, by logged name, as (step, value) in step order: each number of its
    history (`train/<field>`; a field added to StepSummary is logged without a change here, and a
    map of numbers by its keys), each number of any other repeated record of the run that carries
    a step (`<field>/<name>`), and each deployment's weight-sync seconds by version."""
    out: dict[str, list[tuple[int, float]]] = {}

    def add_one(record, step: int, prefix: str) -> None:
        for fd in record.DESCRIPTOR.fields:  # every field: zeros are values too
            if fd.name in NOT_SCALARS:
                continue
            value = getattr(record, fd.name)
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                for key, inner in value.items():
                    if isinstance(inner, int | float):  # a map of numbers: by its keys
                        out.setdefault(key, []).append((step, float(inner)))
                    elif hasattr(inner, "DESCRIPTOR"):  # of records (per source): `<map>/<key>/<name>`
                        add_one(inner, step, f"{prefix}{fd.name}/{key}/")
            elif not fd.is_repeated and fd.type in _NUMBERS:
                out.setdefault(prefix + fd.name, []).append((step, float(value)))

    def add(records, prefix: str) -> None:
        for record in records:
            add_one(record, int(record.step), prefix)

    add(run.history, history_tag(""))
    for fd in run.DESCRIPTOR.fields:
        if (
            fd.is_repeated
            and fd.message_type is not None
            and fd.name not in ("history", "samples")
            and "step" in fd.message_type.fields_by_name
        ):
            add(getattr(run, fd.name), f"{fd.name}/")
    for w in run.weight_syncs:
        out.setdefault(sync_tag(w.deployment), []).append((int(w.version), float(w.sync_seconds)))
    return {tag: sorted(points) for tag, points in out.items()}


_NUMBERS = frozenset(
    getattr(FieldDescriptor, name)
    for name in ("TYPE_DOUBLE", "TYPE_FLOAT", "TYPE_INT64", "TYPE_INT32", "TYPE_UINT64", "TYPE_UINT32")
)


@dataclass(frozen=True)
class Series:
    """One line of a panel; `spread` (same length as y) draws y ± spread as a band."""

    label: str
    x: list[float]
    y: list[float]
    spread: list[float] | None = None
    steps: bool = False  # drawn as a step function (integer quantities)
    tag: str = ""  # the scalar it draws (`scalars`)
    spread_tag: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: list[Series]
    legend: bool = False


def _per_step(run: gateway_pb2.Run, field: str) -> list[float]:
    return [float(getattr(h, field)) for h in run.history]


def panels(run: gateway_pb2.Run) -> list[Panel]:
    """The grid's panels, in reading order, from the run's history and weight deliveries."""
    steps = [float(h.step) for h in run.history]

    def line(field: str, label: str = "", stepped: bool = False) -> Series:
        return Series(label or field, steps, _per_step(run, field), steps=stepped, tag=history_tag(field))

    def one(title: str, field: str, ylabel: str) -> Panel:
        return Panel(title, "trainer step", ylabel, [line(field)])

    syncs: dict[str, list[gateway_pb2.WeightSync]] = {}
    for w in sorted(run.weight_syncs, key=lambda w: (w.deployment, w.version)):
        syncs.setdefault(w.deployment, []).append(w)
    return [*_core_panels(run, one, line, steps, syncs), *_evaluation_panels(run)]


def _evaluation_panels(run: gateway_pb2.Run) -> list[Panel]:
    """pass@1 (and pass@k, mean reward) of each held-out evaluation, and pass@1 per task source."""
    if not run.evaluations:
        return []
    at = [float(e.step) for e in run.evaluations]
    series = [Series("pass@1", at, [e.pass_at_1 for e in run.evaluations], tag="evaluations/pass_at_1")]
    if run.evaluations[-1].k:
        series.append(
            Series(
                f"pass@{run.evaluations[-1].k}",
                at,
                [e.pass_at_k for e in run.evaluations],
                tag="evaluations/pass_at_k",
            )
        )
    series.append(
        Series("mean reward", at, [e.mean_reward for e in run.evaluations], tag="evaluations/mean_reward")
    )
    sources = sorted({name for e in run.evaluations for name in e.sources})
    by_source = [
        Series(
            name,
            [float(e.step) for e in run.evaluations if name in e.sources],
            [e.sources[name].pass_at_1 for e in run.evaluations if name in e.sources],
            tag=f"evaluations/sources/{name}/pass_at_1",
        )
        for name in sources
    ]
    return [
        Panel("held-out evaluation", "trainer step", "pass rate / reward", series, legend=True),
        Panel("held-out pass@1 by task source", "trainer step", "pass@1", by_source, legend=True),
    ]


def _core_panels(run: gateway_pb2.Run, one, line, steps: list[float], syncs: dict) -> list[Panel]:
    return [
        Panel(
            "reward",
            "trainer step",
            "reward",
            [
                Series(
                    "mean ± std",
                    steps,
                    _per_step(run, "reward_mean"),
                    _per_step(run, "reward_std"),
                    tag=history_tag("reward_mean"),
                    spread_tag=history_tag("reward_std"),
                )
            ],
            legend=True,
        ),
        one("loss", "loss", "policy loss"),
        one("entropy", "entropy", "nats / token"),
        one("KL to reference", "kl", "nats / token"),
        one("clip fraction", "clip_fraction", "fraction of tokens"),
        one("response length", "mean_response_tokens", "tokens / rollout"),
        one("trained tokens/s", "train_tokens_per_second", "tokens / s"),
        Panel(
            "staleness",
            "trainer step",
            "versions",
            [line("mean_staleness", "mean"), line("max_staleness", "max", stepped=True)],
            legend=True,
        ),
        Panel(
            "importance ratio (trainer / sampler)",
            "trainer step",
            "ratio",
            [
                line("importance_ratio_mean", "mean"),
                line("importance_ratio_max", "max"),
                line("importance_ratio_min", "min"),
                line("importance_ratio_clipped", "outside the clip range"),
            ],
            legend=True,
        ),
        one("groups resampled", "resampled_groups", "groups replaced / step"),
        Panel(
            "weight-sync seconds per version",
            "weight version",
            "seconds",
            [
                Series(name, [float(w.version) for w in ws], [w.sync_seconds for w in ws], tag=sync_tag(name))
                for name, ws in sorted(syncs.items())
            ],
            legend=True,
        ),
    ]


def _pyplot():
    """pyplot on the file-only backend (no display where `looprl run` runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grid_figure(run: gateway_pb2.Run):
    """A matplotlib Figure with one axes per panel (titles as in `panels`)."""
    plt = _pyplot()
    drawn = panels(run)
    cols = 3
    rows = math.ceil(len(drawn) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, drawn, strict=False):
        for series in panel.series:
            if series.steps:
                (line,) = ax.step(series.x, series.y, where="post", label=series.label, linewidth=1.0)
            else:
                (line,) = ax.plot(series.x, series.y, label=series.label, linewidth=1.2)
            if series.spread is not None:
                ax.fill_between(
                    series.x,
                    [y - s for y, s in zip(series.y, series.spread, strict=True)],
                    [y + s for y, s in zip(series.y, series.spread, strict=True)],
                    alpha=0.2,
                    color=line.get_color(),
                )
        if not any(s.x for s in panel.series):
            ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes, alpha=0.6)
        ax.set_title(panel.title)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        if panel.legend and panel.series:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(drawn) :]:
        ax.set_visible(False)
    state = STATE_NAMES.get(run.state, "?")
    fig.suptitle(f"{run.run_id}: {state}, {run.step}/{run.total_steps} steps")
    fig.tight_layout()
    return fig


def table_steps(count: int, rows: int = TABLE_ROWS, tail: int = TABLE_TAIL) -> list[int]:
    """Indices of the history the summary table shows: every k-th step and the last `tail`."""
    every = max(1, math.ceil(count / rows))
    return sorted({*range(0, count, every), *range(max(0, count - tail), count)})


def _which_steps(count: int) -> str:
    every = max(1, math.ceil(count / TABLE_ROWS))
    return "all of them" if every == 1 else f"one in {every} and the last {TABLE_TAIL}"


TABLE_COLUMNS = (
    ("step", "step", "{:d}"),
    ("reward mean", "reward_mean", "{:.3f}"),
    ("reward std", "reward_std", "{:.3f}"),
    ("loss", "loss", "{:+.4f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("KL", "kl", "{:.4f}"),
    ("clip frac", "clip_fraction", "{:.3f}"),
    ("grad norm", "grad_norm", "{:.3f}"),
    ("resp len", "mean_response_tokens", "{:.1f}"),
    ("staleness", "mean_staleness", "{:.2f}"),
    ("ratio max", "importance_ratio_max", "{:.3f}"),
    ("resampled", "resampled_groups", "{:d}"),
    ("train tok/s", "train_tokens_per_second", "{:.0f}"),
    ("rollouts", "num_rollouts", "{:d}"),
    ("seconds", "seconds", "{:.2f}"),
)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def weights_lines(run: gateway_pb2.Run) -> list[str]:
    """What one weight version costs each deployment, what a LoRA run's adapter is, and the run's
    generation traffic (on a shared deployment: its share)."""
    import tomllib

    try:
        recipe = tomllib.loads(run.recipe_toml) if run.recipe_toml else {}
    except tomllib.TOMLDecodeError:
        recipe = {}
    per_deployment: dict[str, list[int]] = {}
    for w in run.weight_syncs:
        if w.bytes:
            per_deployment.setdefault(w.deployment, []).append(w.bytes)
    lines = []
    if per_deployment:
        lines.append(
            "- bytes per weight version: "
            + ", ".join(f"{d} {_mb(sum(b) / len(b))}" for d, b in sorted(per_deployment.items()))
        )
    lora = recipe.get("model", {}).get("lora")
    if isinstance(lora, dict):
        targets = lora.get("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"])
        sizes = [b for bs in per_deployment.values() for b in bs]
        size = f", {_mb(max(sizes))} per version (the adapter's tensors only)" if sizes else ""
        lines.append(
            f"- LoRA adapter: rank {lora.get('rank', 16)}, alpha {lora.get('alpha', 32.0):g}, on "
            f"{', '.join(targets)}{size}"
        )
    tokens = sum(h.num_rollouts * h.mean_response_tokens for h in run.history)
    shared = [d.get("name", "default") for d in recipe.get("deployments", []) if d.get("shared")]
    if tokens:
        where = (
            f" (on shared deployment{'s' if len(shared) > 1 else ''} {', '.join(shared)}: this run's share)"
            if shared
            else ""
        )
        lines.append(f"- generated tokens trained: {tokens:,.0f}{where}")
    return lines


def summary_lines(run: gateway_pb2.Run) -> list[str]:
    first, last = reward_gain(run)
    syncs = [w.sync_seconds for w in run.weight_syncs]
    shown = table_steps(len(run.history))
    lines = [
        f"# Run {run.run_id}",
        "",
        f"![run report]({GRID_IMAGE})",
        "",
        f"- state: {STATE_NAMES.get(run.state, '?')}" + (f" ({run.error})" if run.error else ""),
        f"- steps: {run.step}/{run.total_steps}, trainer weight version {run.weight_version}",
        f"- reward: first steps {first:.3f} -> last steps {last:.3f} ({last - first:+.3f})",
        f"- episodes published {run.episodes_published}, rollouts trained {run.rollouts_trained}",
        f"- dropped: {dict(run.rollouts_dropped) or 'none'}; groups resampled to fill steps: "
        f"{run.resampled_groups}; redelivered duplicates recognised: {run.duplicate_deliveries}",
        f"- deployments: {', '.join(f'{d.deployment}=v{d.version}' for d in run.deployments) or 'n/a'}",
        f"- weight syncs: {len(syncs)}"
        + (f", {sum(syncs) / len(syncs):.3f} s mean, {max(syncs):.3f} s max" if syncs else ""),
        *_dataset_lines(run),
        *_evaluation_lines(run),
        *weights_lines(run),
        "",
        f"{len(shown)} of {len(run.history)} steps ({_which_steps(len(run.history))}); every step is in "
        f"{HISTORY_CSV}.",
        "",
        "| " + " | ".join(name for name, _, _ in TABLE_COLUMNS) + " |",
        "|" + "---:|" * len(TABLE_COLUMNS),
    ]
    for i in shown:
        h = run.history[i]
        lines.append("| " + " | ".join(fmt.format(getattr(h, f)) for _, f, fmt in TABLE_COLUMNS) + " |")
    tables = sample_tables(run)
    if tables:
        step, rows = list(tables.items())[-1]
        lines += [
            "",
            f"## Sample completions of step {step}",
            "",
            f"The last of {len(tables)} tables; every one is in {SAMPLES}.",
            "",
            samples_markdown(rows),
        ]
    return lines


def sample_tables(run: gateway_pb2.Run) -> dict[int, list[gateway_pb2.SampleCompletion]]:
    """The run's samples tables by step, in step order."""
    tables: dict[int, list[gateway_pb2.SampleCompletion]] = {}
    for row in run.samples:
        tables.setdefault(row.step, []).append(row)
    return dict(sorted(tables.items()))


def _cell(text: str) -> str:
    """Text as one markdown table cell: pipes escaped, line breaks kept as <br>."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>") or " "


def samples_markdown(rows: list[gateway_pb2.SampleCompletion]) -> str:
    """One step's samples as a markdown table (the report's, and TensorBoard's text panel)."""
    lines = [
        "| " + " | ".join(header for header, _, _ in SAMPLE_COLUMNS) + " |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [
            _cell(getattr(row, f)) if fmt == "{}" else fmt.format(getattr(row, f))
            for _, f, fmt in SAMPLE_COLUMNS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def samples_lines(run: gateway_pb2.Run) -> list[str]:
    """samples.md: every samples table of the run, by step."""
    lines = [f"# Sample completions of run {run.run_id}", ""]
    for step, rows in sample_tables(run).items():
        lines += [f"## step {step}", "", samples_markdown(rows), ""]
    return lines


def _dataset_lines(run: gateway_pb2.Run) -> list[str]:
    if not run.HasField("dataset"):
        return []
    d = run.dataset
    return [
        f"- dataset: {d.rows} rows, {d.train_rows} trained on, {d.eval_rows} held out, "
        f"{d.filtered_too_long} left out as longer than {d.max_prompt_tokens} prompt tokens "
        f"(longest kept {d.longest_prompt_tokens})"
    ]


def _evaluation_lines(run: gateway_pb2.Run) -> list[str]:
    """The held-out evaluations as a table: overall figures, then pass@1 per task source."""
    if not run.evaluations:
        return []
    k = run.evaluations[-1].k
    sources = sorted({name for e in run.evaluations for name in e.sources})
    lines = [
        "",
        "Held-out evaluation (greedy pass@1" + (f", pass@{k} of {k} samples" if k else "") + "):",
        "",
        "| step | prompts | pass@1 |"
        + (f" pass@{k} |" if k else "")
        + " mean reward | mean length | "
        + " | ".join(f"pass@1 {name}" for name in sources)
        + (" |" if sources else ""),
        "|" + "---:|" * (5 + bool(k) + len(sources)),
    ]
    for e in run.evaluations:
        cells = [str(e.step), str(e.prompts), f"{e.pass_at_1:.3f}"]
        cells += [f"{e.pass_at_k:.3f}"] if k else []
        cells += [f"{e.mean_reward:.3f}", f"{e.mean_response_tokens:.1f}"]
        cells += [f"{e.sources[n].pass_at_1:.3f}" if n in e.sources else "" for n in sources]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_history_csv(run: gateway_pb2.Run, path: Path) -> None:
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow([f for _, f, _ in TABLE_COLUMNS] + ["max_staleness"])
        for h in run.history:
            writer.writerow([getattr(h, f) for _, f, _ in TABLE_COLUMNS] + [h.max_staleness])


def write_report(run: gateway_pb2.Run, out_dir: Path) -> Path:
    """report.png (the grid), summary.md (condensed table) and history.csv; returns the summary."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig = grid_figure(run)
    fig.savefig(out_dir / GRID_IMAGE, dpi=100)
    plt.close(fig)
    write_history_csv(run, out_dir / HISTORY_CSV)
    summary = out_dir / SUMMARY
    summary.write_text("\n".join(summary_lines(run)) + "\n")
    if run.samples:
        (out_dir / SAMPLES).write_text("\n".join(samples_lines(run)) + "\n")
    return summary
