"""Gathering the samples of a prompt into groups, with a timeout policy for stragglers.

A group is complete when `group_size` distinct samples arrived. A group still incomplete
`straggler_timeout_s` after its first sample is closed: kept as a partial group when it has at least
`min_group_size` samples (group-relative advantages need two), dropped otherwise. Samples arriving for a
group that was already closed are dropped as late. Duplicate rollout ids are dropped.

The collector is pure bookkeeping with an injectable clock; the service feeds it and acks/terms the
outcomes on the bus.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.rollout_packer.sequences import DropReason, Rejected, TokenSequence


@dataclass(slots=True)
class Group:
    """The samples of one prompt, ordered by (sample_index, rollout_id) for determinism."""

    group_id: str
    members: list[TokenSequence]
    partial: bool = False

    @property
    def rollout_ids(self) -> list[str]:
        return [m.rollout_id for m in self.members]


@dataclass(slots=True)
class _Open:
    first_seen: float
    expected: int
    members: dict[str, TokenSequence] = field(default_factory=dict)


def _sorted_members(members: dict[str, TokenSequence]) -> list[TokenSequence]:
    return sorted(members.values(), key=lambda s: (s.sample_index, s.rollout_id))


class GroupCollector:
    """Turns a stream of sequences into complete (or timed-out partial) groups, in completion order."""

    def __init__(
        self,
        straggler_timeout_s: float = 300.0,
        min_group_size: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.straggler_timeout_s = straggler_timeout_s
        self.min_group_size = min_group_size
        self._clock = clock
        self._open: dict[str, _Open] = {}
        self._ready: list[Group] = []
        self._closed_groups: set[str] = set()
        self._seen_ids: set[str] = set()

    def add(self, seq: TokenSequence) -> Rejected | None:
        """Take one sequence; returns a rejection when it is a duplicate or arrives too late."""
        if seq.rollout_id in self._seen_ids:
            return Rejected(seq.rollout_id, DropReason.DUPLICATE, "rollout_id: seen before")
        if seq.group_id in self._closed_groups:
            return Rejected(seq.rollout_id, DropReason.LATE, f"group_id: {seq.group_id} already closed")
        self._seen_ids.add(seq.rollout_id)
        group = self._open.get(seq.group_id)
        if group is None:
            group = self._open[seq.group_id] = _Open(self._clock(), seq.group_size)
        group.members[seq.rollout_id] = seq
        if len(group.members) >= group.expected:
            del self._open[seq.group_id]
            self._closed_groups.add(seq.group_id)
            self._ready.append(Group(seq.group_id, _sorted_members(group.members)))
        return None

    def close_group(self, group_id: str) -> None:
        """Mark a group as closed from outside (it belongs to a step already planned or trained)."""
        self._closed_groups.add(group_id)

    def forget(self, rollout_ids: list[str], group_ids: list[str] = ()) -> None:
        """Stop remembering these ids (bounded memory: the caller dedups older ones itself)."""
        self._seen_ids.difference_update(rollout_ids)
        self._closed_groups.difference_update(group_ids)

    def expire(self) -> tuple[list[Group], list[Rejected]]:
        """Close groups past the straggler timeout: partial groups that are big enough become ready."""
        now = self._clock()
        drops: list[Rejected] = []
        partial: list[Group] = []
        for gid in sorted(
            gid for gid, g in self._open.items() if now - g.first_seen >= self.straggler_timeout_s
        ):
            g = self._open.pop(gid)
            self._closed_groups.add(gid)
            if len(g.members) >= self.min_group_size:
                grp = Group(gid, _sorted_members(g.members), partial=True)
                self._ready.append(grp)
                partial.append(grp)
            else:
                detail = (
                    f"group {gid}: {len(g.members)}/{g.expected} samples after {self.straggler_timeout_s}s"
                )
                drops.extend(
                    Rejected(m.rollout_id, DropReason.STRAGGLER_TIMEOUT, detail, gid)
                    for m in g.members.values()
                )
        return partial, drops

    def take_ready(self) -> list[Group]:
        """Groups completed since the last call, in completion order."""
        ready, self._ready = self._ready, []
        return ready

    @property
    def open_groups(self) -> int:
        return len(self._open)

    @property
    def open_rollouts(self) -> int:
        return sum(len(g.members) for g in self._open.values())
