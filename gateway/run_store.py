"""Run records in the JetStream KV bucket "runs": one record per run, its step history and weight
deliveries in chunks beside it (a step rewrites one chunk, never the whole history), and
compare-and-set updates so concurrent writers (the driver, the RPC handlers) never lose one."""

from __future__ import annotations

import asyncio
import json
import re
import uuid

from services.kit.bus.kv import KV, KVConflict
from services.kit.config.recipe import RunRecord

# Started and not ended: a driver feeds them. A "queued" run (gateway/queue.py) is neither.
ACTIVE = ("pending", "running")
FINAL = ("completed", "failed", "stopped")


def new_run_id(name: str) -> str:
    slug = re.sub(r"[^a-zA-Z0-9_-]+", "-", name).strip("-")[:40] or "run"
    return f"{slug}-{uuid.uuid4().hex[:6]}"


# Steps per history chunk: a step rewrites one chunk, never the whole history.
HISTORY_CHUNK = 100
# RunRecord.extra: the steps whose weights were evaluated, in order, and the latest figures (the
# evaluations themselves are chunks beside the record).
EVALUATED_KEY = "evaluated_steps"
LAST_EVALUATION_KEY = "last_evaluation"
# Sample tables per chunk (tables are larger than steps: up to logging.samples_per_step rows of text).
SAMPLE_TABLES_PER_CHUNK = 10


def _sample_order(row: dict) -> tuple[int, int]:
    return row["step"], row.get("row", 0)


class RunStore:
    """Run records in the "runs" KV bucket (key: run id), updated with compare-and-set. The per-step
    history lives beside them in chunks (keys `<run id>.history.<n>`), so the record every service
    watches stays small: with the history inside it, each step rewrote (and every watcher re-parsed)
    a record growing by a line per step."""

    def __init__(self, kv: KV) -> None:
        self.kv = kv
        # The last revision of each record this store read or wrote: an update tries it first and
        # reads the record again only when another writer got in between (the compare-and-set fails).
        self._latest: dict[str, tuple[int, bytes]] = {}
        # The chunks this store appended to: the driver is their only writer, so an append need not
        # read back the chunk it wrote last.
        self._chunks: dict[str, list[dict]] = {}

    async def create(self, record: RunRecord) -> None:
        await self.kv.create(record.run_id, record.to_json())

    async def get(self, run_id: str) -> RunRecord | None:
        entry = await self.kv.entry(run_id)
        if entry is None:
            self._latest.pop(run_id, None)
            return None
        self._latest[run_id] = (entry.revision, entry.value)
        return RunRecord.from_json(entry.value)

    async def list(self) -> list[RunRecord]:
        records = [
            RunRecord.from_json(raw) for raw in (await self.kv.items("*")).values()
        ]  # run ids: one token
        return sorted(records, key=lambda r: r.created_at)

    async def history(self, record: RunRecord) -> list[dict]:
        """The run's per-step entries, in step order."""
        out = await self._read_chunks(record.run_id, "history", -(-max(record.step, 0) // HISTORY_CHUNK))
        return sorted(out, key=lambda h: h["step"])

    async def add_history(self, run_id: str, entry: dict) -> None:
        """Add one step's entry (idempotent: a redelivered step is not added twice). Only the run's
        driver writes a run's history."""
        await self._append_once(run_id, "history", entry["step"], entry, ("step",))

    async def weight_syncs(self, record: RunRecord) -> list[dict]:
        """Every version delivered to every deployment, in (version, deployment) order."""
        newest = max((int(v) for v in record.extra.get("deployments", {}).values()), default=-1)
        out = await self._read_chunks(record.run_id, "syncs", newest // HISTORY_CHUNK + 1)
        return sorted(out, key=lambda w: (w["version"], w["deployment"]))

    async def add_weight_sync(self, run_id: str, entry: dict) -> None:
        """Add one delivery (idempotent per deployment and version), in chunks by version beside the
        record like the history. Only the run's driver writes them."""
        await self._append_once(run_id, "syncs", entry["version"], entry, ("version", "deployment"))

    async def evaluations(self, record: RunRecord) -> list[dict]:
        """The run's held-out evaluations (gateway/evaluation.py), oldest first."""
        count = len(record.extra.get(EVALUATED_KEY, ()))
        out = await self._read_chunks(record.run_id, "evals", -(-count // HISTORY_CHUNK))
        return sorted(out, key=lambda e: e["step"])

    async def add_evaluation(self, run_id: str, ordinal: int, entry: dict) -> None:
        """Add the run's `ordinal`-th evaluation (idempotent per step), in chunks beside the record
        like the history; the record lists the steps evaluated (EVALUATED_KEY)."""
        await self._append_once(run_id, "evals", ordinal, entry, ("step",))

    async def samples(self, record: RunRecord, every: int) -> list[dict]:
        """The sample tables of a run that records one every `every` steps, in (step, row) order."""
        if every <= 0:
            return []
        chunks = max(record.step, 0) // every // SAMPLE_TABLES_PER_CHUNK + 1
        return sorted(await self._read_chunks(record.run_id, "samples", chunks), key=_sample_order)

    async def add_samples(self, run_id: str, step: int, rows: list[dict], every: int) -> None:
        """Add one step's samples table (idempotent per step), SAMPLE_TABLES_PER_CHUNK tables a chunk.
        Only the run's driver writes them."""
        key = f"{run_id}.samples.{step // every // SAMPLE_TABLES_PER_CHUNK}"
        entries = self._chunks.get(key)
        if entries is None:
            raw = await self.kv.get(key)
            entries = json.loads(raw) if raw else []
        if any(e["step"] == step for e in entries):
            return
        entries = [*entries, *({**row, "step": step, "row": i} for i, row in enumerate(rows))]
        await self.kv.put(key, json.dumps(entries).encode())
        self._chunks = {k: v for k, v in self._chunks.items() if not k.startswith(f"{run_id}.samples.")}
        self._chunks[key] = entries

    async def _read_chunks(self, run_id: str, kind: str, chunks: int) -> list[dict]:
        """The entries of a run's first `chunks` chunks of `kind`. The chunk its driver (in this
        process, the only writer) appended to last is the one that grows every step: it is not
        read back from the bus at every WatchRun poll."""
        out: list[dict] = []
        for chunk in range(chunks):
            key = f"{run_id}.{kind}.{chunk}"
            entries = self._chunks.get(key)
            if entries is None:
                raw = await self.kv.get(key)
                entries = json.loads(raw) if raw else []
            out.extend(entries)
        return out

    async def _append_once(
        self, run_id: str, kind: str, index: int, entry: dict, identity: tuple[str, ...]
    ) -> None:
        """Append entry to chunk index // HISTORY_CHUNK unless an entry with the same identity
        fields is already there."""
        key = f"{run_id}.{kind}.{index // HISTORY_CHUNK}"
        entries = self._chunks.get(key)
        if entries is None:
            raw = await self.kv.get(key)
            entries = json.loads(raw) if raw else []
        if any(all(e[f] == entry[f] for f in identity) for e in entries):
            return
        entries = [*entries, entry]
        await self.kv.put(key, json.dumps(entries).encode())
        # Keep the chunk appended to last: steps go to the current chunk (an older one only for a
        # late step, which is read afresh and becomes the one kept).
        self._chunks = {k: v for k, v in self._chunks.items() if not k.startswith(f"{run_id}.{kind}.")}
        self._chunks[key] = entries

    def forget(self, run_id: str) -> None:
        """Drop what this store remembers of a run whose driver ended."""
        self._latest.pop(run_id, None)
        self._chunks = {k: v for k, v in self._chunks.items() if not k.startswith(f"{run_id}.")}

    async def update(self, run_id: str, change) -> RunRecord:
        """Apply change(record) and write it back; retried on concurrent writes."""
        latest = self._latest.get(run_id)
        for attempt in range(20):
            if latest is None or attempt:
                entry = await self.kv.entry(run_id)
                if entry is None:
                    self._latest.pop(run_id, None)
                    raise KeyError(run_id)
                latest = (entry.revision, entry.value)
            record = RunRecord.from_json(latest[1])
            change(record)
            value = record.to_json()
            try:
                revision = await self.kv.update(run_id, value, latest[0])
            except KVConflict:
                self._latest.pop(run_id, None)
                if attempt:
                    await asyncio.sleep(0.01)
                continue
            self._latest[run_id] = (revision, value)
            return record
        raise RuntimeError(f"run {run_id}: too many concurrent updates")
