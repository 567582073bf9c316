"""Which element ranges of a parameter a receiver has staged: detects overlaps and completeness."""

from __future__ import annotations


class Coverage:
    """Element ranges of one parameter already staged (sorted, disjoint)."""

    __slots__ = ("covered", "numel", "ranges")

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.ranges: list[tuple[int, int]] = []
        self.covered = 0

    def add(self, start: int, stop: int) -> bool:
        """Record [start, stop); False if it overlaps what is already there."""
        added = stop - start
        ranges = self.ranges
        lo, hi = 0, len(ranges)
        while lo < hi:  # first range whose stop > start
            mid = (lo + hi) // 2
            if ranges[mid][1] <= start:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(ranges) and ranges[lo][0] < stop:
            return False
        # Merge with neighbours that touch, so a fully staged tensor is a single range.
        if lo > 0 and ranges[lo - 1][1] == start:
            start = ranges[lo - 1][0]
            lo -= 1
            del ranges[lo]
        if lo < len(ranges) and ranges[lo][0] == stop:
            stop = ranges[lo][1]
            del ranges[lo]
        ranges.insert(lo, (start, stop))
        self.covered += added
        return True

    @property
    def complete(self) -> bool:
        return self.covered == self.numel
