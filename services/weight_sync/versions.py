"""Incoming versions: trainer ranks push dim-0 chunks; we verify, keep and index them.

A `VersionBuffer` collects the chunks of one version from every trainer rank. Each chunk is
copied once into the version's shared-memory arena (transport/arena.py ChunkArena) and its
trainer hash64 is verified on the bytes as they sit there (a chunk without one is refused): from then on they are the single copy every delivery
reads (gRPC buckets are assembled from them; co-located receivers read their slices straight
out of the arena, reshard-on-read). Without an arena (no shared memory wanted) the chunk stays in
the received message's bytes. It knows which chunks have arrived, so a delivery planned from the previous
version's layout can start sending a bucket as soon as its chunks are in (pipelining), and
it is complete when every rank said `last`. Validation names the field that is wrong; any bad
chunk drops the whole version (nothing of it is ever delivered).
"""

from __future__ import annotations

import asyncio
import math
import time
import warnings
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import numpy as np
import torch

from looprl.weightsync.v1 import weightsync_pb2
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument
from services.weight_sync.transport.arena import ArenaPool, ChunkArena
from services.weights import itemsize
from services.weights.checksum import SliceChecksum, landing_sums, verify_slice
from services.weights.specs import torch_dtype_of

from .plan import ChunkKey, ChunkMeta, SourceParam, TrainerLayout


@dataclass
class VersionBuffer:
    version: int
    world_size: int
    run_id: str = ""
    model_config_json: str = ""
    chunks: dict[ChunkKey, torch.Tensor] = field(default_factory=dict)  # 2-D (rows, width) views
    rows: dict[ChunkKey, int] = field(default_factory=dict)
    params: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    ranks_done: set[int] = field(default_factory=set)
    bytes_received: int = 0
    started: float = field(default_factory=time.monotonic)
    failed: str = ""
    expected: dict[str, tuple[int, ...]] | None = None  # HF names and shapes, once the model config is known
    arena: ChunkArena | None = None  # shared memory holding the chunks (None: they stay in the messages)
    locations: dict[ChunkKey, tuple[str, int]] = field(default_factory=dict)  # chunk -> (segment, offset)
    sums: dict[ChunkKey, object] = field(default_factory=dict)  # checksum.landing_sums of each arena chunk
    pushes: list[object] = field(default_factory=list)  # span context of each rank's PushShards (links)
    _arrived: asyncio.Condition | None = None
    _holds: int = 0
    _retired: bool = False

    # -------------------------------------------------- arena lifetime
    def hold(self) -> None:
        """A delivery reads this version's chunks: keep the arena until `release`."""
        self._holds += 1

    def release(self) -> None:
        self._holds -= 1
        self._free_if_unused()

    def retire(self) -> None:
        """The store dropped this version; its arena goes back to the pool once no delivery reads it."""
        self._retired = True
        self._free_if_unused()

    def _free_if_unused(self) -> None:
        if self._retired and self._holds <= 0 and self.arena is not None:
            arena, self.arena = self.arena, None
            self.chunks.clear()  # the views would see the next version's bytes
            self.locations.clear()
            self.sums.clear()
            arena.release()

    @property
    def complete(self) -> bool:
        return not self.failed and len(self.ranks_done) == self.world_size

    def add_chunk(self, rank: int, chunk: weightsync_pb2.ShardChunk, index: int) -> int:
        where = f"shards[{index}]"
        if not chunk.name:
            raise InvalidArgument(f"{where}.name: must not be empty")
        dtype = torch_dtype_of(chunk.dtype)
        if dtype is None:
            raise InvalidArgument(f"{where}.dtype: {chunk.name} has unsupported dtype enum {chunk.dtype}")
        shape = tuple(int(d) for d in chunk.global_shape)
        if not shape or any(d <= 0 for d in shape):
            raise InvalidArgument(f"{where}.global_shape: {chunk.name} has invalid shape {list(shape)}")
        if self.expected is not None:
            if chunk.name not in self.expected:
                raise InvalidArgument(f"{where}.name: unknown parameter name {chunk.name!r} for this model")
            if shape != self.expected[chunk.name]:
                raise InvalidArgument(
                    f"{where}.global_shape: {chunk.name} is {list(shape)}, the model config says "
                    f"{list(self.expected[chunk.name])}"
                )
        known = self.params.get(chunk.name)
        if known is not None and known != (shape, dtype):
            raise InvalidArgument(
                f"{where}.global_shape: {chunk.name} is {list(shape)} {dtype}, another chunk said "
                f"{list(known[0])} {known[1]}"
            )
        if chunk.row_offset < 0 or chunk.rows < 0 or chunk.row_offset + chunk.rows > shape[0]:
            raise InvalidArgument(
                f"{where}.row_offset: rows [{chunk.row_offset}, {chunk.row_offset + chunk.rows}) of "
                f"{chunk.name} are outside its {shape[0]} rows"
            )
        width = math.prod(shape[1:])
        expected = chunk.rows * width * itemsize(dtype)
        data = chunk.data
        if len(data) != expected:
            raise InvalidArgument(
                f"{where}.data: {chunk.name} rows={chunk.rows} x {width} {dtype} needs {expected} bytes, "
                f"got {len(data)}"
            )
        stored = data
        if self.arena is not None and expected:
            segment, offset, view = self.arena.alloc(expected)
            stored = view
        # The trainer's hash64, checked on the bytes every delivery will read: hashed block by block as
        # each lands in the arena, in the same pass as the copy.
        checksum = SliceChecksum("hash64", int(chunk.hash64)) if chunk.HasField("hash64") else None
        verify_slice(
            checksum,
            data,
            where=where,
            what=f"{chunk.name} rows from {chunk.row_offset}",
            into=None if stored is data else np.frombuffer(stored, np.uint8),
        )
        self.params[chunk.name] = (shape, dtype)
        if chunk.rows == 0:
            return 0
        key = (chunk.name, rank, int(chunk.row_offset))
        if key in self.chunks:
            raise InvalidArgument(
                f"{where}.row_offset: {chunk.name} rows from {chunk.row_offset} pushed twice"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: we only ever read from it
            flat = torch.frombuffer(stored, dtype=dtype) if expected else torch.empty(0, dtype=dtype)
        self.chunks[key] = flat.view(chunk.rows, width)
        if stored is not data:
            self.locations[key] = (segment, offset)
            # Recorded from the same arena bytes the checksum just verified: the expected sum64 of any
            # receiver slice derives from these, so the chain from the trainer's checksum holds.
            self.sums[key] = landing_sums(np.frombuffer(stored, np.uint8).reshape(chunk.rows, -1))
        self.rows[key] = int(chunk.rows)
        self.bytes_received += expected
        return expected

    def layout(self) -> TrainerLayout:
        """The trainer layout this version arrived in; checks the chunks tile every parameter."""
        by_name: dict[str, list[ChunkMeta]] = {n: [] for n in self.params}
        for key, rows in self.rows.items():
            by_name[key[0]].append(ChunkMeta(key, rows))
        params = {}
        for name, (shape, dtype) in self.params.items():
            chunks = sorted(by_name[name], key=lambda c: c.key[2])
            row = 0
            for c in chunks:
                if c.key[2] != row:
                    gap = "overlap" if c.key[2] < row else "gap"
                    raise InvalidArgument(
                        f"shards.row_offset: {name} has a {gap} at row {min(row, c.key[2])} across trainer ranks"
                    )
                row += c.rows
            if row != shape[0]:
                raise InvalidArgument(f"shards.rows: {name} covers {row} of its {shape[0]} rows")
            params[name] = SourceParam(name, shape, dtype, tuple(chunks))
        return TrainerLayout(params)

    # ------------------------------------------------------- pipelining
    def _condition(self) -> asyncio.Condition:
        if self._arrived is None:
            self._arrived = asyncio.Condition()
        return self._arrived

    async def notify(self) -> None:
        cond = self._condition()
        async with cond:
            cond.notify_all()

    async def wait_for(self, keys: AbstractSet[ChunkKey]) -> None:
        """Until every key has arrived; raises if the version fails or completes without them."""
        cond = self._condition()
        async with cond:
            while True:
                if self.failed:
                    raise RuntimeError(f"version {self.version} failed: {self.failed}")
                if keys.issubset(self.chunks.keys()):
                    return
                if self.complete:
                    raise RuntimeError(f"version {self.version} arrived in a different layout than planned")
                await cond.wait()


@dataclass
class RunVersions:
    """One run's versions: those being pushed and the latest complete one. Version numbers count
    that run's trainer steps, so two runs' version 3 are two different versions."""

    run_id: str
    latest: VersionBuffer | None = None
    latest_version: int = -1  # survives restarts via KV even when the bytes do not
    pending: dict[int, VersionBuffer] = field(default_factory=dict)

    @property
    def latest_bytes_held(self) -> bool:
        """Whether the latest version's bytes are here; a restart keeps only its number (KV)."""
        return self.latest is not None and self.latest.version == self.latest_version


class VersionStore:
    """The versions being pushed and the latest complete one (kept to serve RequestSync), per run.

    A push naming no run belongs to `default_run` (the config's run_id). `latest`, `latest_version`
    and `pending` are those of `primary()`: the default run, or the only run when exactly one
    other pushed (the single-run view)."""

    def __init__(
        self,
        latest_version: int = -1,
        *,
        shm: bool = True,
        arena_segment_bytes: int = 256 << 20,
        default_run: str = "default",
    ) -> None:
        self.arenas = ArenaPool(arena_segment_bytes) if shm else None
        self.default_run = default_run
        self.runs: dict[str, RunVersions] = {}
        self.last_run = ""  # the run that completed a version last (what any-run targets receive)
        if latest_version >= 0:
            self.run(default_run).latest_version = latest_version

    # ------------------------------------------------------------ runs
    def run_of(self, run_id: str) -> str:
        return run_id or self.default_run

    def run(self, run_id: str) -> RunVersions:
        """The versions of `run_id` (empty: the default run), created on first use."""
        run_id = self.run_of(run_id)
        rv = self.runs.get(run_id)
        if rv is None:
            rv = self.runs[run_id] = RunVersions(run_id)
        return rv

    def primary(self) -> RunVersions:
        """The default run's versions, or the only run's when exactly one other run pushed."""
        rv = self.runs.get(self.default_run)
        if rv is None and len(self.runs) == 1:
            rv = next(iter(self.runs.values()))
        return rv or RunVersions(self.default_run)

    def serving(self, run_id: str) -> RunVersions:
        """The versions a target of `run_id` receives; a target of any run (empty) receives those
        of the run that completed a version last (the single-run stack)."""
        if run_id:
            return self.runs.get(run_id) or RunVersions(run_id)
        return self.runs.get(self.last_run) or self.primary()

    @property
    def latest(self) -> VersionBuffer | None:
        return self.primary().latest

    @property
    def latest_version(self) -> int:
        return self.primary().latest_version

    @property
    def pending(self) -> dict[int, VersionBuffer]:
        return self.primary().pending

    def is_pending(self, run_id: str, version: int) -> bool:
        rv = self.runs.get(self.run_of(run_id))
        return rv is not None and version in rv.pending

    # -------------------------------------------------------- versions
    def buffer_for(self, request: weightsync_pb2.PushShardsRequest) -> VersionBuffer:
        v = request.version
        if v < 0:
            raise InvalidArgument(f"version: must be >= 0, got {v}")
        rv = self.runs.get(self.run_of(request.run_id)) or RunVersions(self.run_of(request.run_id))
        # A restart keeps the latest version's number (KV) but not its bytes: the trainer may push
        # that version again, or targets that had not received it could never get it.
        lost = v == rv.latest_version and not rv.latest_bytes_held
        if v <= rv.latest_version and not lost:
            raise FailedPrecondition(
                f"version: {v} is not newer than the latest complete version {rv.latest_version} "
                f"(of run {rv.run_id!r})"
            )
        if request.trainer_world_size < 1:
            raise InvalidArgument(f"trainer_world_size: must be >= 1, got {request.trainer_world_size}")
        if not 0 <= request.trainer_rank < request.trainer_world_size:
            raise InvalidArgument(
                f"trainer_rank: {request.trainer_rank} is outside [0, {request.trainer_world_size})"
            )
        rv = self.run(rv.run_id)  # a valid push: the run is known from now on
        buf = rv.pending.get(v)
        if buf is None:
            arena = self.arenas.arena() if self.arenas is not None else None
            buf = VersionBuffer(v, request.trainer_world_size, rv.run_id, arena=arena)
            rv.pending[v] = buf
        elif buf.world_size != request.trainer_world_size:
            raise InvalidArgument(
                f"trainer_world_size: version {v} is being pushed with world size {buf.world_size}, got "
                f"{request.trainer_world_size}"
            )
        if request.trainer_rank in buf.ranks_done:
            raise FailedPrecondition(
                f"trainer_rank: rank {request.trainer_rank} already finished version {v}"
            )
        if request.model_config_json and not buf.model_config_json:
            buf.model_config_json = request.model_config_json
        return buf

    def fail(self, version: int, reason: str, run_id: str = "") -> None:
        rv = self.runs.get(self.run_of(run_id))
        buf = rv.pending.pop(version, None) if rv is not None else None
        if buf is not None:
            buf.failed = reason
            buf.retire()

    def completed(self, buf: VersionBuffer) -> None:
        """buf is complete: it becomes its run's latest; the run's older pending versions are dropped."""
        rv = self.run(buf.run_id)
        rv.pending.pop(buf.version, None)
        for v in [v for v in rv.pending if v < buf.version]:
            self.fail(v, f"superseded by version {buf.version}", rv.run_id)
        if rv.latest is not None and rv.latest is not buf:
            rv.latest.retire()
        rv.latest = buf
        rv.latest_version = buf.version
        self.last_run = rv.run_id

    def restored(self, run_id: str, latest_version: int) -> None:
        """The latest version number of `run_id` as KV kept it (its bytes are gone)."""
        rv = self.run(run_id)
        rv.latest_version = max(rv.latest_version, latest_version)

    def free(self, run_id: str) -> None:
        """No target of `run_id` is left: its latest version's bytes go (its number stays, so an
        older version is still refused); versions still being pushed are kept for a new target."""
        rv = self.runs.get(self.run_of(run_id))
        if rv is not None and rv.latest is not None:
            latest, rv.latest = rv.latest, None
            latest.retire()

    def close(self) -> None:
        """Unlink every shared-memory segment (weight-sync shutting down)."""
        if self.arenas is not None:
            self.arenas.close()
