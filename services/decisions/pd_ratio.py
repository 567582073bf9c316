"""The prefill:decode ratio of one deployment: which split of its workers balances the two stages.

Prefill is compute-bound and costs per prompt token; decode is bandwidth-bound and costs per output
token, cheaper per token the larger the batch a decode worker holds. For a split of `workers` into
P prefill and D decode workers the deployment serves at most

    prefill:  P x prefill_tokens_per_s / mean_prompt_tokens             requests/s
    decode:   D x decode_tokens_per_s(batch per decode worker) / mean_output_tokens   requests/s

and the slower stage sets its throughput. `tune` picks the split that maximises it, from what was
measured (each stage's tokens/s per worker, decode at several batch sizes) and observed (the prompt
and output lengths of the requests routed to the deployment, the sequences in flight).

It is a controller, and one that reacts to its own moves oscillates, so it decides only:

- at a weight-version boundary (a new version than the last decision's; every worker then holds no
  request that straddles the change, since a request's prefill and decode run at one version),
- on enough evidence (`min_requests` observed since the last decision),
- when the predicted gain over the current split is at least `min_gain` (hysteresis),
- by at most `max_move` workers at a time (bounded moves toward the best split),
- and not sooner than `min_versions_between` versions after its last move.

Pure: `tune(inputs, policy, last)` returns a `RatioDecision` carrying the split, whether it changed,
a reason code and sentence, the predicted throughput of the current and the chosen split, and the
inputs themselves (`as_log()` is what a service logs and exports). The inference-router calls it per
deployment at each version boundary; the deployment simulator (sim/) calls the same function.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.decisions.cost_model import CostModel, decode_tokens_per_s, prefill_tokens_per_s

REASON_INITIAL = "initial"
REASON_REBALANCED = "rebalanced"
REASON_BOUNDED = "rebalanced_bounded"
REASON_NOT_BOUNDARY = "not_a_version_boundary"
REASON_TOO_SOON = "too_soon_after_last_move"
REASON_FEW_REQUESTS = "too_few_requests"
REASON_HYSTERESIS = "within_hysteresis"
REASON_BALANCED = "already_best"
REASON_NO_SPLIT = "budget_too_small"
REASONS = (
    REASON_INITIAL,
    REASON_REBALANCED,
    REASON_BOUNDED,
    REASON_NOT_BOUNDARY,
    REASON_TOO_SOON,
    REASON_FEW_REQUESTS,
    REASON_HYSTERESIS,
    REASON_BALANCED,
    REASON_NO_SPLIT,
)


@dataclass(frozen=True)
class Ratio:
    prefill: int
    decode: int

    @property
    def workers(self) -> int:
        return self.prefill + self.decode

    def __str__(self) -> str:
        return f"{self.prefill}:{self.decode}"


@dataclass(frozen=True)
class LengthStats:
    """The lengths of the requests routed to the deployment since the last decision. A request of n
    completions (a GRPO group) is prefilled once and decoded n times: its output tokens are those of
    all its completions."""

    requests: int
    mean_prompt_tokens: float
    mean_output_tokens: float
    completions_per_request: float = 1.0

    @classmethod
    def of(
        cls, prompts: Sequence[int], outputs: Sequence[int], completions_per_request: float = 1.0
    ) -> LengthStats:
        """From each request's prompt tokens and output tokens (summed over its completions)."""
        n = len(outputs)
        if n == 0:
            return cls(0, 0.0, 0.0, completions_per_request)
        return cls(n, sum(prompts) / max(1, len(prompts)), sum(outputs) / n, completions_per_request)


@dataclass(frozen=True)
class StageRates:
    """Measured speeds of one worker of each stage."""

    # Prompt tokens/s of a prefill worker, at the deployment's prompt lengths.
    prefill_tokens_per_s: float
    # (batch size, output tokens/s) of a decode worker, at the deployment's context lengths; between
    # points linear, beyond them flat.
    decode_points: tuple[tuple[int, float], ...]
    # Most sequences one decode worker holds (slots, or KV capacity over the context length).
    max_decode_batch: int

    def decode_tokens_per_s(self, batch: float) -> float:
        points = sorted(self.decode_points)
        batches = [b for b, _ in points]
        batch = min(max(batch, 1.0), float(self.max_decode_batch))
        i = bisect.bisect_left(batches, batch)
        if i == 0:
            return points[0][1]
        if i == len(points):
            return points[-1][1]
        (b0, t0), (b1, t1) = points[i - 1], points[i]
        return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)


@dataclass(frozen=True)
class TuningInputs:
    """Everything a decision rests on (logged with it)."""

    deployment: str
    weight_version: int
    workers: int
    current: Ratio | None
    lengths: LengthStats
    rates: StageRates
    # Sequences (completions) in flight in the deployment (0: enough to fill every decode worker).
    in_flight: float = 0.0


@dataclass(frozen=True)
class TunerPolicy:
    """How eagerly the tuner moves."""

    min_gain: float = 0.10
    max_move: int = 2
    min_requests: int = 64
    min_versions_between: int = 1
    min_prefill_workers: int = 1
    min_decode_workers: int = 1


@dataclass(frozen=True)
class RatioDecision:
    ratio: Ratio
    changed: bool
    reason: str
    detail: str
    inputs: TuningInputs
    # Requests/s the current and the chosen split are predicted to serve, and the best split.
    current_requests_per_s: float = 0.0
    chosen_requests_per_s: float = 0.0
    best: Ratio | None = None
    # Version of the last move (for the min_versions_between rule).
    moved_at_version: int = -1

    def as_log(self) -> dict[str, Any]:
        """The decision and its inputs as plain values (what a service logs)."""
        out = asdict(self)
        out["ratio"] = str(self.ratio)
        out["best"] = str(self.best) if self.best else None
        out["inputs"]["current"] = str(self.inputs.current) if self.inputs.current else None
        return out


@dataclass(frozen=True)
class StageThroughput:
    prefill_requests_per_s: float
    decode_requests_per_s: float
    decode_batch: float

    @property
    def requests_per_s(self) -> float:
        return min(self.prefill_requests_per_s, self.decode_requests_per_s)

    @property
    def bottleneck(self) -> str:
        return "prefill" if self.prefill_requests_per_s < self.decode_requests_per_s else "decode"


def throughput(ratio: Ratio, inputs: TuningInputs) -> StageThroughput:
    """Requests/s each stage of this split serves, by the inputs' speeds and lengths."""
    rates, lengths = inputs.rates, inputs.lengths
    prompt = max(lengths.mean_prompt_tokens, 1.0)
    output = max(lengths.mean_output_tokens, 1.0)
    prefill = ratio.prefill * rates.prefill_tokens_per_s / prompt
    if ratio.decode <= 0:
        return StageThroughput(prefill, 0.0, 0.0)
    batch = float(rates.max_decode_batch)
    if inputs.in_flight > 0:
        batch = min(batch, max(1.0, inputs.in_flight / ratio.decode))
    decode = ratio.decode * rates.decode_tokens_per_s(batch) / output
    return StageThroughput(prefill, decode, batch)


def best_split(inputs: TuningInputs, policy: TunerPolicy) -> tuple[Ratio, StageThroughput] | None:
    """The split of the budget with the highest throughput (ties: the more balanced one)."""
    lo, hi = policy.min_prefill_workers, inputs.workers - policy.min_decode_workers
    if hi < lo:
        return None
    scored = []
    for p in range(lo, hi + 1):
        ratio = Ratio(p, inputs.workers - p)
        t = throughput(ratio, inputs)
        balance = abs(math.log(max(t.prefill_requests_per_s, 1e-12) / max(t.decode_requests_per_s, 1e-12)))
        scored.append((-t.requests_per_s, balance, p, ratio, t))
    _, _, _, ratio, t = min(scored, key=lambda s: s[:3])
    return ratio, t


def _toward(current: Ratio, target: Ratio, max_move: int) -> Ratio:
    step = max(-max_move, min(max_move, target.prefill - current.prefill))
    prefill = current.prefill + step
    return Ratio(prefill, current.workers - prefill)


def tune(
    inputs: TuningInputs, policy: TunerPolicy | None = None, last: RatioDecision | None = None
) -> RatioDecision:
    """The deployment's split after this weight version, with why."""
    policy = policy or TunerPolicy()
    previous = inputs.current or (last.ratio if last is not None else None)
    moved_at = last.moved_at_version if last is not None else -1

    def decision(ratio: Ratio, reason: str, detail: str, **kw: Any) -> RatioDecision:
        changed = ratio != previous
        return RatioDecision(
            ratio,
            changed,
            reason,
            detail,
            inputs,
            moved_at_version=inputs.weight_version if changed else moved_at,
            **kw,
        )

    found = best_split(inputs, policy)
    if found is None:
        ratio = previous or Ratio(max(0, inputs.workers - 1), min(1, inputs.workers))
        return decision(ratio, REASON_NO_SPLIT, f"{inputs.workers} workers cannot hold both stages")
    best, best_t = found
    if previous is None:
        return decision(
            best,
            REASON_INITIAL,
            f"start at {best} ({best_t.bottleneck}-bound at {best_t.requests_per_s:.3g} req/s)",
            chosen_requests_per_s=best_t.requests_per_s,
            best=best,
        )
    keep = previous
    if keep.workers != inputs.workers:  # the budget changed: the same proportion of the new one
        lo, hi = policy.min_prefill_workers, inputs.workers - policy.min_decode_workers
        prefill = min(hi, max(lo, round(keep.prefill * inputs.workers / max(keep.workers, 1))))
        keep = Ratio(prefill, inputs.workers - prefill)
    now = throughput(keep, inputs)
    facts: dict[str, Any] = {"current_requests_per_s": now.requests_per_s, "best": best}
    if last is not None and inputs.weight_version <= last.inputs.weight_version:
        return decision(
            keep, REASON_NOT_BOUNDARY, f"version {inputs.weight_version} already decided", **facts
        )
    if moved_at >= 0 and inputs.weight_version - moved_at < policy.min_versions_between:
        return decision(keep, REASON_TOO_SOON, f"moved at version {moved_at}", **facts)
    if inputs.lengths.requests < policy.min_requests:
        detail = f"{inputs.lengths.requests} < {policy.min_requests} requests"
        return decision(keep, REASON_FEW_REQUESTS, detail, **facts)
    if best == keep:
        detail = f"{keep} is the best split"
        return decision(keep, REASON_BALANCED, detail, chosen_requests_per_s=now.requests_per_s, **facts)
    gain = best_t.requests_per_s / max(now.requests_per_s, 1e-12) - 1.0
    if gain < policy.min_gain:
        detail = f"{best} would gain {gain:.1%} over {keep}, under {policy.min_gain:.0%}"
        return decision(keep, REASON_HYSTERESIS, detail, chosen_requests_per_s=now.requests_per_s, **facts)
    target = _toward(keep, best, policy.max_move)
    chosen = throughput(target, inputs)
    bounded = target != best
    return decision(
        target,
        REASON_BOUNDED if bounded else REASON_REBALANCED,
        f"{keep} -> {target}{f' (toward {best})' if bounded else ''}: {now.bottleneck}-bound at "
        f"{now.requests_per_s:.3g} req/s, predicted {chosen.requests_per_s:.3g} (+{gain:.0%} at {best})",
        chosen_requests_per_s=chosen.requests_per_s,
        **facts,
    )


def rates_from_cost_model(
    cost: CostModel,
    lengths: LengthStats,
    max_decode_batch: int,
    kv_tokens: int = 0,
    prefill_tokens_per_batch: int = 8192,
) -> StageRates:
    """The stage speeds a cost model predicts at these lengths: what a deployment that has not
    measured itself yet (or the simulator) gives the tuner. The decode batch is bounded by the
    slots and, when `kv_tokens` is set, by how many sequences of this length its KV cache holds."""
    prompt = max(1, round(lengths.mean_prompt_tokens))
    output = max(1.0, lengths.mean_output_tokens / max(lengths.completions_per_request, 1.0))
    per_batch = max(1, prefill_tokens_per_batch // prompt)
    cap = max_decode_batch
    if kv_tokens:
        cap = max(1, min(cap, int(kv_tokens // (prompt + output))))
    context = int(prompt + output / 2)
    batches = sorted({*(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b < cap), cap})
    points = tuple((b, decode_tokens_per_s(cost, b, context)) for b in batches)
    return StageRates(prefill_tokens_per_s(cost, prompt, per_batch), points, cap)
