"""Planning a step's micro-batches: balanced across data-parallel ranks, packed under a token budget.

FSDP ranks synchronise at every micro-batch (all-gather in forward, reduce-scatter in backward), so two
things matter: every rank runs the SAME number of micro-batches (or collectives hang), and the j-th
micro-batch of every rank costs about the same (or ranks wait at each sync). The plan therefore works on
R x M bins at once instead of "balance ranks, then pack each rank":

1. M = the fewest micro-batches per rank that can hold the step: ceil(tokens / (R * budget)).
2. Longest-processing-time first over the R*M bins with a token capacity: items sorted by cost
   (desc, ties by rollout id), each placed into the cheapest bin that still has token room. With
   cost = tokens, the cheapest bin is also the emptiest: bins end up nearly full AND nearly equal.
   When that fails (bins kept level end up each just too full for the next item), the tail of the
   order (the small items) is placed best-fit instead, from earlier and earlier positions; then
   first-fit-decreasing into the same R*M bins is tried; only when all fail does M grow by one. So M never exceeds
   first-fit-decreasing's bin count rounded up to whole rounds of R.
3. A local-improvement pass moves/swaps items between the most and least loaded bins.
4. Bins are dealt to ranks in rounds of R (sorted by cost), the costliest bin of a round going to the
   rank with the least work so far: the j-th micro-batches of all ranks are alike, rank totals balance.

Ranks whose bins stay empty (fewer sequences than R*M) get padding micro-batches (see packing.py),
never fewer micro-batches. Cost = tokens + attention_weight * tokens^2 (0: tokens only).
Everything is deterministic for the same set of (length, id) items.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PackPlan:
    """bins[r][j]: indices (into the planned items) of rank r's j-th micro-batch, in layout order."""

    world_size: int
    micro_batches_per_rank: int
    max_tokens: int
    bins: list[list[np.ndarray]]
    tokens: np.ndarray  # int64 [R, M]
    cost: np.ndarray  # float64 [R, M]
    too_long: np.ndarray  # indices of items longer than the budget (not planned)

    @property
    def total_tokens(self) -> int:
        return int(self.tokens.sum())

    @property
    def rank_cost(self) -> np.ndarray:
        return self.cost.sum(axis=1)

    @property
    def rank_imbalance(self) -> float:
        """max/mean work per rank (1.0 is perfect)."""
        rc = self.rank_cost
        mean = float(rc.mean())
        return float(rc.max()) / mean if mean > 0 else 1.0

    @property
    def padding_fraction(self) -> float:
        """Unused share of the micro-batch token budget: what padding each micro-batch to the budget
        would cost. It bounds the per-micro-batch sync idling of ranks from above."""
        slots = self.world_size * self.micro_batches_per_rank * self.max_tokens
        return 1.0 - self.total_tokens / slots if slots else 0.0

    @property
    def sync_idle_fraction(self) -> float:
        """Share of rank-time spent waiting for the slowest rank at each micro-batch."""
        busy = self.world_size * float(self.cost.max(axis=0).sum())
        return 1.0 - float(self.cost.sum()) / busy if busy > 0 else 0.0


def sequence_cost(lengths: np.ndarray, attention_weight: float = 0.0) -> np.ndarray:
    lens = np.asarray(lengths, dtype=np.float64)
    return lens + attention_weight * lens * lens if attention_weight else lens


def plan_packing(
    lengths: np.ndarray,
    keys: np.ndarray,
    world_size: int,
    max_tokens: int,
    attention_weight: float = 0.0,
    improve_iterations: int = 64,
) -> PackPlan:
    """Plan the micro-batches of one step. `keys` (e.g. each sequence's place in the step) break ties
    deterministically."""
    if world_size <= 0:
        raise ValueError(f"world_size: {world_size} must be > 0")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens: {max_tokens} must be > 0")
    lens = np.asarray(lengths, dtype=np.int64)
    keys = np.asarray(keys)
    if lens.shape != keys.shape:
        raise ValueError(f"lengths {lens.shape} and keys {keys.shape} differ")
    if lens.size and lens.min() <= 0:
        raise ValueError("lengths: every sequence needs at least one token")
    costs = sequence_cost(lens, attention_weight)
    fits = lens <= max_tokens
    too_long = np.flatnonzero(~fits)
    idx = np.flatnonzero(fits)
    order = idx[np.lexsort((keys[idx], -costs[idx]))]

    total = int(lens[idx].sum())
    m = max(1, math.ceil(total / (world_size * max_tokens)))
    lens_l, costs_l, order_l = lens.tolist(), costs.tolist(), order.tolist()
    cost_is_tokens = attention_weight == 0
    while True:
        nbins = world_size * m
        assign, failed_at = _lpt(order_l, lens_l, costs_l, nbins, max_tokens, cost_is_tokens, len(order_l))
        # Worst-fit (what LPT is under a capacity) keeps bins level, so near the end every bin may be
        # just too full for the next item although first-fit would have found room. Then place the
        # tail of the order (the small items) best-fit instead, switching earlier and earlier.
        switch = failed_at
        while assign is None and switch > 0:
            switch = max(0, switch - max(1, len(order_l) // 8))
            assign, _ = _lpt(order_l, lens_l, costs_l, nbins, max_tokens, cost_is_tokens, switch)
        if assign is None:
            assign = _first_fit(order, lens, nbins, max_tokens)
            improve_iterations = max(improve_iterations, min(4 * nbins, 4096))
        if assign is not None:
            break
        m += 1
    nbins = world_size * m
    members: list[list[int]] = [[] for _ in range(nbins)]
    for i in order_l:  # layout order inside a bin = placement order
        members[assign[i]].append(i)
    placed = np.asarray(assign, dtype=np.int64)[order]
    bin_tokens = np.bincount(placed, weights=lens[order], minlength=nbins).astype(np.int64)
    bin_cost = np.bincount(placed, weights=costs[order], minlength=nbins).astype(np.float64)
    _improve(members, bin_tokens, bin_cost, lens, costs, max_tokens, improve_iterations)

    rank_of_bin, index_of_bin = _deal_to_ranks(bin_cost, world_size, m)
    bins: list[list[np.ndarray]] = [[None] * m for _ in range(world_size)]  # type: ignore[list-item]
    tokens = np.zeros((world_size, m), dtype=np.int64)
    cost = np.zeros((world_size, m), dtype=np.float64)
    for b in range(nbins):
        r, j = rank_of_bin[b], index_of_bin[b]
        bins[r][j] = np.asarray(members[b], dtype=np.int64)
        tokens[r, j] = bin_tokens[b]
        cost[r, j] = bin_cost[b]
    return PackPlan(world_size, m, max_tokens, bins, tokens, cost, too_long)


def _lpt(
    order: list[int],
    lens: list[int],
    costs: list[float],
    nbins: int,
    cap: int,
    cost_is_tokens: bool,
    best_fit_from: int,
) -> tuple[list[int] | None, int]:
    """Items order[:best_fit_from] into the cheapest bin with room, the rest into the fullest bin with
    room. Returns (assignment, len(order)) or (None, position of the item that fit nowhere).

    When the cheapest bin lacks room (only possible with an attention term), the item goes to the bin
    with the most room: the heap then holds a stale entry for that bin, skipped when it surfaces.
    """
    heap = [(0.0, b) for b in range(nbins)]  # sorted, hence a valid heap
    load = [0.0] * nbins
    room = [cap] * nbins
    room_np = np.full(nbins, cap, dtype=np.int64)
    assign = [0] * len(lens)
    for pos, i in enumerate(order):
        need = lens[i]
        if pos >= best_fit_from:
            fitting = np.flatnonzero(room_np >= need)
            if fitting.size == 0:
                return None, pos
            b = int(fitting[np.argmin(room_np[fitting])])
            load[b] += costs[i]
            heapq.heappush(heap, (load[b], b))
        else:
            c, b = heap[0]
            while c != load[b]:  # stale entry
                heapq.heappop(heap)
                c, b = heap[0]
            if room[b] >= need:
                load[b] = c + costs[i]
                heapq.heapreplace(heap, (load[b], b))
            else:
                if cost_is_tokens:
                    return None, pos  # the cheapest bin is the emptiest: nothing has room
                b = int(np.argmax(room_np))
                if room[b] < need:
                    return None, pos
                load[b] += costs[i]
                heapq.heappush(heap, (load[b], b))
        room[b] -= need
        room_np[b] = room[b]
        assign[i] = b
    return assign, len(order)


def _first_fit(order: np.ndarray, lens: np.ndarray, nbins: int, cap: int) -> list[int] | None:
    room = np.full(nbins, cap, dtype=np.int64)
    assign = [0] * lens.size
    for i in order.tolist():
        b = int(np.argmax(room >= lens[i]))
        if room[b] < lens[i]:
            return None
        room[b] -= lens[i]
        assign[i] = b
    return assign


def _improve(
    members: list[list[int]],
    bin_tokens: np.ndarray,
    bin_cost: np.ndarray,
    lens: np.ndarray,
    costs: np.ndarray,
    cap: int,
    iterations: int,
) -> None:
    """Move or swap items between the costliest and cheapest bin while that narrows their gap."""
    for _ in range(iterations):
        hi = int(np.argmax(bin_cost))
        lo = int(np.argmin(bin_cost))
        gap = bin_cost[hi] - bin_cost[lo]
        if hi == lo or gap <= 1e-9 or not members[hi]:
            return
        a = np.asarray(members[hi], dtype=np.int64)
        b = np.asarray(members[lo], dtype=np.int64)
        room_hi = cap - bin_tokens[hi]
        room_lo = cap - bin_tokens[lo]
        # Moving cost d from hi to lo leaves the pair's max at max(hi - d, lo + d): best d near gap/2.
        best_gain, best = 0.0, None
        d_move = costs[a]
        ok = (lens[a] <= room_lo) & (d_move < gap)
        if ok.any():
            gains = np.where(ok, gap - np.abs(gap - 2 * d_move), -1.0)
            k = int(np.argmax(gains))
            if gains[k] > best_gain:
                best_gain, best = float(gains[k]), (k, None)
        if b.size:
            d_swap = costs[a][:, None] - costs[b][None, :]
            dl = lens[a][:, None] - lens[b][None, :]
            ok = (d_swap > 0) & (d_swap < gap) & (dl <= room_lo) & (-dl <= room_hi)
            if ok.any():
                gains = np.where(ok, gap - np.abs(gap - 2 * d_swap), -1.0)
                k = int(np.argmax(gains))
                if gains.flat[k] > best_gain + 1e-12:
                    best_gain, best = float(gains.flat[k]), divmod(k, b.size)
        if best is None:
            return
        ka, kb = best
        x = int(a[ka])
        members[hi].remove(x)
        members[lo].append(x)
        moved_tokens, moved_cost = lens[x], costs[x]
        if kb is not None:
            y = int(b[kb])
            members[lo].remove(y)
            members[hi].append(y)
            moved_tokens, moved_cost = moved_tokens - lens[y], moved_cost - costs[y]
        bin_tokens[hi] -= moved_tokens
        bin_tokens[lo] += moved_tokens
        bin_cost[hi] -= moved_cost
        bin_cost[lo] += moved_cost


def _deal_to_ranks(bin_cost: np.ndarray, world_size: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Rounds of R bins (costliest first); in each round the costliest bin goes to the least-loaded rank."""
    order = np.lexsort((np.arange(bin_cost.size), -bin_cost))
    rank_of_bin = np.zeros(bin_cost.size, dtype=np.int64)
    index_of_bin = np.zeros(bin_cost.size, dtype=np.int64)
    load = np.zeros(world_size, dtype=np.float64)
    ranks = np.arange(world_size)
    for j in range(m):
        round_bins = order[j * world_size : (j + 1) * world_size]
        takers = np.lexsort((ranks, load))  # least loaded first, ties by rank
        rank_of_bin[round_bins] = takers
        index_of_bin[round_bins] = j
        load[takers] += bin_cost[round_bins]
    return rank_of_bin, index_of_bin
