"""The packer's durable memory: which rollouts make up which step, and which steps were trained.

One KV entry per planned step (`<run>.step.<k>`, JSON). A plan is written BEFORE any of its
micro-batches is served and marked acked BEFORE its rollouts are acked on the bus, so after a crash:

- a planned, unacked step is rebuilt from exactly its recorded rollouts (redelivered, since unacked);
  the rebuild is deterministic, so every rank sees the same batch as before the crash;
- a redelivered rollout of an acked step is recognised, acked and dropped: never trained twice.

An acked record is forgotten only when all three hold: it is not among the newest `keep_acked`, it
was acked more than `settle_s` ago (a bus ack sent just before a crash may not have landed, and the
redelivery comes one ack-wait later), and none of its rollouts is `unsettled` - still pending on the
bus because the packer that planned it died holding it, so the bus will redeliver it after its ack
wait, however many steps later. A record whose unsettled rollouts never come back (the stream lost
them) is forgotten after `10 * settle_s`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from services.kit.bus import subjects
from services.kit.bus.kv import KV


@dataclass
class StepRecord:
    step: int
    trainer_version: int
    world_size: int
    groups: dict[str, list[str]]  # group id -> rollout ids
    acked: bool = False
    acked_version: int = -1
    acked_at: float = 0.0  # wall-clock time of the trainer's AckStep
    unsettled: list[str] = field(default_factory=list)  # acked step's rollouts not yet acked on the bus
    extra: dict = field(default_factory=dict)

    @property
    def rollout_ids(self) -> list[str]:
        return [rid for gid in sorted(self.groups) for rid in self.groups[gid]]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> StepRecord:
        return cls(**json.loads(raw))


class StepStore:
    """Step records of one run in a KV bucket."""

    def __init__(self, kv: KV, run_id: str, keep_acked: int = 8, settle_s: float = 65.0) -> None:
        self.kv = kv
        self.run_id = run_id
        self.keep_acked = keep_acked
        self.settle_s = settle_s

    def _key(self, step: int | str) -> str:
        return subjects.packer_step_key(self.run_id, step)

    async def load(self) -> dict[int, StepRecord]:
        records: dict[int, StepRecord] = {}
        for raw in (await self.kv.items(self._key("*"))).values():
            if raw:
                record = StepRecord.from_json(raw)
                records[record.step] = record
        return records

    async def save(self, record: StepRecord) -> None:
        await self.kv.put(self._key(record.step), record.to_json())

    async def prune(self, records: dict[int, StepRecord], now: float | None = None) -> list[int]:
        """Forget the acked records no redelivery can need any more; returns the steps forgotten."""
        now = time.time() if now is None else now
        acked = sorted(s for s, r in records.items() if r.acked)
        old = [
            step
            for step in acked[: max(0, len(acked) - self.keep_acked)]
            if self._settled(records[step], now)
        ]
        for step in old:
            await self.kv.delete(self._key(step))
        return old

    def _settled(self, record: StepRecord, now: float) -> bool:
        age = now - record.acked_at
        return age > self.settle_s and (not record.unsettled or age > 10 * self.settle_s)
