"""Packing benchmark: padding, DP balance and speed of the rollout packer against naive batching.

10,000 rollouts with log-normal lengths (median ~1k, max 16k tokens), DP = 8, a 16k-token micro-batch
budget. Baselines in the same run: pad-to-longest batches with as many sequences per batch as the
packer's micro-batches hold on average (arrival order), round-robin assignment of sequences to ranks,
and round-robin + a textbook per-rank first-fit-decreasing (pure Python) for the timing.
"""

from __future__ import annotations

import numpy as np

from bench.common import emit, median, parse_args, timed
from bench.harness.synthetic_rollouts import lognormal_lengths, make_sequences
from services.rollout_packer.groups import Group
from services.rollout_packer.step import PackerSettings, build_step

BENCH = "packing"


def pad_to_longest_fraction(lengths: np.ndarray, batch_size: int) -> float:
    n = lengths.size - lengths.size % batch_size
    full = lengths[:n].reshape(-1, batch_size)
    slots = int(full.max(axis=1).sum()) * batch_size
    used = int(full.sum())
    rest = lengths[n:]
    if rest.size:
        slots += int(rest.max()) * rest.size
        used += int(rest.sum())
    return 1.0 - used / slots


def round_robin_imbalance(costs: np.ndarray, world: int) -> float:
    per_rank = np.array([costs[r::world].sum() for r in range(world)])
    return float(per_rank.max() / per_rank.mean())


def round_robin_ffd(lengths: np.ndarray, world: int, budget: int) -> list[int]:
    """The textbook path: deal sequences round-robin, then first-fit-decreasing per rank (lists).
    Returns the micro-batch count of each rank (unequal counts hang FSDP collectives)."""
    bins = []
    for r in range(world):
        rooms: list[int] = []
        for n in sorted(lengths[r::world].tolist(), reverse=True):
            for k, room in enumerate(rooms):
                if room >= n:
                    rooms[k] = room - n
                    break
            else:
                rooms.append(budget - n)
        bins.append(len(rooms))
    return bins


def main() -> None:
    args = parse_args(__doc__ or BENCH)
    # --quick keeps the 10k-rollout step (planning it is what is measured) and repeats less
    n, world, budget, group = 10_000, 8, 16384, 8
    repeat = 2 if args.quick else 5
    rng = np.random.default_rng(0)
    lengths = lognormal_lengths(n, rng, median=1000, max_len=16384)
    seqs = make_sequences(lengths, group, rng)
    groups = [Group(seqs[i].group_id, seqs[i : i + group]) for i in range(0, n, group)]
    settings = PackerSettings(max_tokens_per_microbatch=budget, world_size=world, estimator="grpo")

    step = build_step(0, groups, 0, settings)
    pack_s = median(timed(lambda: build_step(0, groups, 0, settings), repeat=repeat, warmup=1))
    baseline_pack_s = median(timed(lambda: round_robin_ffd(lengths, world, budget), repeat=1, warmup=0))
    plan = step.plan

    def materialise() -> None:
        for r in range(world):
            for _ in step.micro_batches(r):
                pass

    mat_s = median(timed(materialise, repeat=1 if args.quick else 2, warmup=0 if args.quick else 1))

    micro_batches = world * plan.micro_batches_per_rank
    batch_size = max(1, round(n / micro_batches))
    base_pad = pad_to_longest_fraction(lengths, batch_size)
    base_imb = round_robin_imbalance(lengths.astype(np.float64), world)
    # the quadratic-attention cost model, for the table
    attn = build_step(
        0,
        groups,
        0,
        PackerSettings(max_tokens_per_microbatch=budget, world_size=world, attention_weight=1 / (6 * 896)),
    )
    attn_base = round_robin_imbalance(lengths + lengths.astype(np.float64) ** 2 / (6 * 896), world)

    print(
        f"{n} rollouts, {int(lengths.sum())} tokens, lengths median {int(np.median(lengths))} "
        f"max {int(lengths.max())}, DP={world}, budget {budget} tokens/micro-batch"
    )
    print(f"{'':34}{'packer':>12}{'baseline':>12}")
    print(
        f"{'padding fraction':34}{plan.padding_fraction:12.4f}{base_pad:12.4f}  (pad-to-longest, {batch_size}/batch)"
    )
    print(f"{'rank imbalance (max/mean)':34}{plan.rank_imbalance:12.4f}{base_imb:12.4f}  (round-robin)")
    print(f"{'rank imbalance, attention cost':34}{attn.plan.rank_imbalance:12.4f}{attn_base:12.4f}")
    print(f"{'per-micro-batch sync idle':34}{plan.sync_idle_fraction:12.4f}")
    rr_counts = round_robin_ffd(lengths, world, budget)
    print(
        f"{'micro-batches per rank':34}{plan.micro_batches_per_rank:12d}{min(rr_counts):>7d}-{max(rr_counts)}"
    )
    print(
        f"{'plan step (advantages+packing) ms':34}{pack_s * 1e3:12.1f}{baseline_pack_s * 1e3:12.1f}  (rr + FFD)"
    )
    print(f"{'materialise all micro-batches ms':34}{mat_s * 1e3:12.1f}")

    size = f"{n // 1000}k"
    emit(
        BENCH,
        "padding_fraction",
        plan.padding_fraction,
        base_pad,
        plan.padding_fraction / base_pad,
        "fraction",
        "<= 0.02",
        checks="value",
    )
    emit(BENCH, "baseline_padding_fraction", base_pad, None, None, "fraction", "tens of percent")
    emit(
        BENCH,
        "rank_imbalance",
        plan.rank_imbalance,
        base_imb,
        plan.rank_imbalance / base_imb,
        "max/mean",
        "<= 1.02",
        checks="value",
    )
    emit(BENCH, "baseline_rank_imbalance", base_imb, None, None, "max/mean", "round-robin")
    emit(
        BENCH,
        f"pack_ms_{size}",
        pack_s * 1e3,
        baseline_pack_s * 1e3,
        pack_s / baseline_pack_s,
        "ms",
        "< 200",
        checks="value",
    )
    emit(BENCH, f"materialize_ms_{size}", mat_s * 1e3, None, None, "ms", "streamed per micro-batch")


if __name__ == "__main__":
    main()
