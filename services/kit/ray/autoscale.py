"""Replica-count policy: scale between min and max by queue depth, with a slower way down.

Pure and clock-injected so it is tested without actors. Scaling up happens as soon as the queue
per replica passes the target; scaling down only after the pool has wanted fewer replicas for
`down_after_s`, so a bursty load does not make replicas flap (each start costs seconds).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Autoscaler:
    min_replicas: int
    max_replicas: int
    target_queue_per_replica: float = 4.0
    down_after_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _low_since: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(
                f"replicas: need 0 <= min ({self.min_replicas}) <= max ({self.max_replicas}), max >= 1"
            )

    def desired(self, current: int, queue_depth: int) -> int:
        """Replica count to have now, given `current` replicas and `queue_depth` waiting+running."""
        wanted = math.ceil(queue_depth / self.target_queue_per_replica) if queue_depth > 0 else 0
        wanted = max(self.min_replicas, min(self.max_replicas, max(wanted, 1 if queue_depth else 0)))
        wanted = max(wanted, self.min_replicas)
        if wanted >= current:
            self._low_since = None
            return wanted
        now = self.clock()
        if self._low_since is None:
            self._low_since = now
        if now - self._low_since >= self.down_after_s:
            self._low_since = now
            return max(wanted, current - 1)  # one at a time
        return current
