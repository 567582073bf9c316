"""Receiver side of a weight sync: stage version v beside the serving one, verify, then commit.

An inference replica owns one WeightStager built from its own parameter specs (names, shapes
and dtype of its layout and TP rank, e.g. `services.modeling.layouts.rank_params`). Every
StageWeights request is handed to `stage()`: each slice is checked against the specs (name,
dtype, full shape, element range, no overlap with bytes already staged), its bytes are
copied into preallocated staging tensors and their checksum is verified on what landed there
(checksum.verify_slice: hash64 or sum64, computed block by block during the copy, so verification
costs little more than the copy; a slice without a checksum is refused). Slices marked shm_adopt
are not copied at all: the staged tensor becomes a read-only view of weight-sync's shared copy of
the layout (several co-located deployments then serve from one copy of the weights), and only the
slices that carry a sum64 are verified here, the others by the peers that share the copy. The
serving weights are never touched. `commit(v)` returns the complete state dict for the replica to swap in
atomically; `abort(v)` drops the staged bytes. Any rejected slice aborts the staged version,
so a half-verified version can never be committed; the sender retries the whole version.

Rollback (canaries): the replica hands the tensors it retires on a commit back with
`give_back`; they stay the rollback point (version v-1, complete) until the next version
starts staging into them, so `rollback(v)` can return v-1 with no extra copy of the model.

Version rules: a version must be newer than the serving one; a newer version replaces an
older, incomplete staged one; buckets of one version may arrive over several StageWeights
calls and in any order.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from looprl.inference.v1 import inference_pb2

from .checksum import SliceChecksum, verify_slice
from .coverage import Coverage
from .errors import IncompleteVersion, InvalidWeights, StaleVersion
from .shm import ShmReader
from .specs import ParamLike, ParamSpec, as_param_specs, dtype_name, itemsize, torch_dtype_of
from .wire import DecodedStageRequest, SliceLike


@dataclass
class StageProgress:
    version: int
    bytes_received: int
    complete: bool


class WeightStager:
    """Stages weight versions for one receiver (one TP rank of one replica)."""

    def __init__(
        self,
        params: Iterable[ParamLike] | Mapping[str, torch.Tensor],
        *,
        serving_version: int = -1,
        rank: int | None = None,
        verify_checksums: bool = True,
        device: str | torch.device = "cpu",
    ) -> None:
        self.specs: dict[str, ParamSpec] = {p.name: p for p in as_param_specs(params)}
        if not self.specs:
            raise ValueError("a WeightStager needs at least one parameter")
        self.serving_version = serving_version
        self.rank = rank
        self.verify_checksums = verify_checksums
        self.device = torch.device(device)  # where staged tensors live (GPU engines: their device)
        self.total_bytes = sum(p.nbytes for p in self.specs.values())
        self.model_config_json = ""
        self._lock = threading.RLock()
        self._version: int | None = None
        self._tensors: dict[str, torch.Tensor] = {}
        self._flat: dict[str, torch.Tensor] = {}
        self._coverage: dict[str, Coverage] = {}
        self._bytes = 0
        self._staged_config = ""
        self._spare: dict[str, torch.Tensor] = {}
        self._retiring: int | None = None  # version that stopped serving at the last commit
        self._previous: tuple[int, dict[str, torch.Tensor]] | None = None  # the rollback point
        # Kept for the stager's lifetime: weight-sync reuses its segments, and mapping one afresh
        # per bucket populates the page tables of the whole segment each time (tens of ms for the
        # default 256 MB arena, on every version of even a tiny model: bench/weight_sync.py).
        self._shm = ShmReader()
        self._last_refreshed: int | None = None
        self._adopted: dict[str, tuple[str, int]] = {}  # name -> (segment, byte offset) this version
        self._shared_ptrs: set[int] = set()  # data pointers of read-only adopted tensors

    # ----------------------------------------------------------------- state
    @property
    def staged_version(self) -> int | None:
        return self._version

    @property
    def bytes_staged(self) -> int:
        return self._bytes

    def is_complete(self, version: int | None = None) -> bool:
        with self._lock:
            if self._version is None or (version is not None and version != self._version):
                return False
            return all(c.complete for c in self._coverage.values())

    def missing(self) -> dict[str, int]:
        """Elements not yet staged, per parameter (for error messages and status pages)."""
        with self._lock:
            return {n: c.numel - c.covered for n, c in self._coverage.items() if not c.complete}

    # ------------------------------------------------------------- staging
    def stage(
        self, request: inference_pb2.StageWeightsRequest | DecodedStageRequest, shm: ShmReader | None = None
    ) -> StageProgress:
        """Verify and stage every slice of one bucket (a parsed request, or one decoded without
        copying its payload by `wire.decode_stage_request`). On any error the staged version is
        dropped (nothing is ever swapped from a version that failed verification)."""
        with self._lock:
            version = int(request.version)
            self._begin(version)
            if self.rank is not None and request.rank != self.rank:
                self._drop()
                raise InvalidWeights(f"rank: bucket for rank {request.rank} sent to rank {self.rank}")
            if request.model_config_json:
                self._staged_config = request.model_config_json
            reader = shm if shm is not None else self._shm
            if shm is None and version != self._last_refreshed:
                self._shm.refresh()  # forget segments a restarted sender replaced
                self._last_refreshed = version
            slices: Sequence[SliceLike] = request.slices
            try:
                for i, sl in enumerate(slices):
                    if sl.shm_adopt:
                        self._adopt_slice(i, sl, reader)
                        continue
                    data = reader.slice_bytes(i, sl)
                    self._stage_slice(
                        i, sl.name, int(sl.dtype), tuple(sl.shape), int(sl.offset), data, SliceChecksum.of(sl)
                    )
            except Exception:
                self._drop()
                raise
            return StageProgress(version, self._bytes, self.is_complete(version))

    def stage_tensor(self, version: int, name: str, offset: int, data: torch.Tensor) -> StageProgress:
        """Stage a flat range from a tensor already in this process (device transports, tests)."""
        with self._lock:
            self._begin(version)
            spec = self._spec(0, name)
            flat = data.reshape(-1)
            self._check_range(0, spec, offset, flat.numel())
            if data.dtype != spec.dtype:
                raise InvalidWeights(
                    f"slices[0].dtype: {name} is {dtype_name(spec.dtype)}, got {dtype_name(data.dtype)}"
                )
            if not self._coverage[name].add(offset, offset + flat.numel()):
                self._drop()
                raise InvalidWeights(f"slices[0].offset: {name} range overlaps bytes already staged")
            self._flat[name][offset : offset + flat.numel()].copy_(flat, non_blocking=True)
            self._bytes += flat.numel() * itemsize(spec.dtype)
            return StageProgress(version, self._bytes, self.is_complete(version))

    def commit(self, version: int) -> dict[str, torch.Tensor]:
        """The complete staged state dict of `version`, to swap in atomically. The stager now
        reports `version` as serving; the tensors belong to the caller."""
        with self._lock:
            if self._version != version:
                staged = "nothing" if self._version is None else f"version {self._version}"
                raise IncompleteVersion(f"version: cannot commit {version}, {staged} is staged")
            if not self.is_complete(version):
                missing = self.missing()
                some = ", ".join(f"{n} ({k} elements)" for n, k in list(missing.items())[:3])
                raise IncompleteVersion(
                    f"version: {version} is incomplete: {len(missing)} parameters missing data, e.g. {some}"
                )
            state = self._tensors
            self._retiring = self.serving_version
            self.serving_version = version
            self.model_config_json = self._staged_config or self.model_config_json
            self._reset()
            return state

    def abort(self, version: int | None = None) -> bool:
        """Drop the staged version (if it is `version`, or whatever is staged when None)."""
        with self._lock:
            if self._version is None or (version is not None and version != self._version):
                return False
            self._drop()
            return True

    def give_back(self, state: Mapping[str, torch.Tensor]) -> None:
        """Hand back the tensors retired by the last commit (the version served before it). They
        are the rollback point until the next version starts staging, then its staging buffers, so
        a replica holds two copies of its weights at most and pages stay warm."""
        with self._lock:
            usable = self._usable(state)
            retiring, self._retiring = self._retiring, None
            if retiring is not None and retiring >= 0 and len(usable) == len(self.specs):
                self._previous = (retiring, usable)
            else:
                self._spare.update(self._writable(usable))

    def recycle(self, state: Mapping[str, torch.Tensor]) -> None:
        """Tensors that hold no version worth keeping become staging buffers."""
        with self._lock:
            self._spare.update(self._writable(self._usable(state)))

    @property
    def rollback_version(self) -> int | None:
        """The version `rollback` would return to, if the replica still holds it."""
        return None if self._previous is None else self._previous[0]

    def rollback(self, version: int) -> tuple[int, dict[str, torch.Tensor]]:
        """Undo the commit of `version` (which must be serving): returns (previous version, its
        tensors) for the replica to swap back in. Hand the retired tensors of `version` to
        `recycle`: a rolled-back version is never served again."""
        with self._lock:
            if version != self.serving_version:
                raise IncompleteVersion(
                    f"version: cannot roll back {version}, this replica serves {self.serving_version}"
                )
            if self._previous is None:
                raise IncompleteVersion(
                    f"version: cannot roll back {version}, the version before it is no longer held "
                    "(staging a newer version reuses its buffers)"
                )
            previous, state = self._previous
            self._previous = None
            self._retiring = None
            self.serving_version = previous
            return previous, state

    def _usable(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state.items():
            spec = self.specs.get(name)
            if (
                spec is not None
                and tuple(t.shape) == spec.shape
                and t.dtype == spec.dtype
                and t.is_contiguous()
            ):
                out[name] = t
        return out

    def _writable(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors that may become staging buffers: not views of a read-only shared copy."""
        return {n: t for n, t in state.items() if t.data_ptr() not in self._shared_ptrs}

    # ------------------------------------------------------------ internals
    def _begin(self, version: int) -> None:
        if version <= self.serving_version:
            raise StaleVersion(
                f"version: {version} is not newer than the serving version {self.serving_version}"
            )
        if self._version is not None:
            if version < self._version:
                raise StaleVersion(f"version: {version} is older than the staged version {self._version}")
            if version == self._version:
                return
            self._drop()  # a newer version supersedes an unfinished one
        self._version = version
        self._bytes = 0
        if self._previous is not None:  # new bytes land in the rollback point's buffers: it is gone
            self._spare.update(self._writable(self._previous[1]))
            self._previous = None
        for name, spec in self.specs.items():
            tensor = self._spare.pop(name, None)
            if tensor is None:
                tensor = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            self._tensors[name] = tensor
            self._flat[name] = tensor.view(-1)
            self._coverage[name] = Coverage(spec.numel)

    def _spec(self, i: int, name: str) -> ParamSpec:
        spec = self.specs.get(name)
        if spec is None:
            self._drop()
            raise InvalidWeights(f"slices[{i}].name: unknown parameter {name!r} for this receiver")
        return spec

    def _check_range(self, i: int, spec: ParamSpec, offset: int, count: int) -> None:
        if offset < 0 or offset + count > spec.numel:
            self._drop()
            raise InvalidWeights(
                f"slices[{i}].offset: elements [{offset}, {offset + count}) are outside {spec.name} "
                f"({spec.numel} elements)"
            )

    def _check_meta(self, i: int, name: str, dtype: int, shape: tuple[int, ...]) -> ParamSpec:
        spec = self._spec(i, name)
        got = torch_dtype_of(dtype)
        if got != spec.dtype:
            raise InvalidWeights(
                f"slices[{i}].dtype: {name} is {dtype_name(spec.dtype)} here, got "
                f"{dtype_name(got) if got is not None else f'enum {dtype}'}"
            )
        if shape != spec.shape:
            raise InvalidWeights(
                f"slices[{i}].shape: {name} has shape {list(spec.shape)} here, got {list(shape)}"
            )
        return spec

    def _adopt_slice(self, i: int, sl: SliceLike, reader: ShmReader) -> None:
        """Stage a slice of a shared copy by reference: the parameter's staged tensor becomes a
        read-only view of the copy (one per parameter, all its slices must agree on where)."""
        name = sl.name
        spec = self._check_meta(i, name, int(sl.dtype), tuple(sl.shape))
        size = itemsize(spec.dtype)
        offset, nbytes = int(sl.offset), int(sl.nbytes)
        if not sl.shm_name or nbytes % size:
            raise InvalidWeights(
                f"slices[{i}].shm_adopt: {name} needs a segment and a whole number of "
                f"{dtype_name(spec.dtype)} ({nbytes} bytes)"
            )
        count = nbytes // size
        self._check_range(i, spec, offset, count)
        base = int(sl.shm_offset) - offset * size
        if base < 0 or base % size:
            raise InvalidWeights(
                f"slices[{i}].shm_offset: {name} would start at byte {base} of {sl.shm_name!r}, "
                f"not a {dtype_name(spec.dtype)} boundary"
            )
        where = (sl.shm_name, base)
        if self.device.type != "cpu":  # a device engine copies the shared bytes to its device
            data = reader.view(sl.shm_name, int(sl.shm_offset), nbytes)
            expected = SliceChecksum.of(sl)
            self._stage_slice(
                i,
                name,
                int(sl.dtype),
                spec.shape,
                offset,
                data,
                expected,
                verified_elsewhere=expected is None,
            )
            return
        held = self._adopted.get(name)
        if held is None:
            if self._coverage[name].covered:
                raise InvalidWeights(f"slices[{i}].shm_adopt: {name} mixes copied and adopted slices")
            with warnings.catch_warnings():  # read-only by design: inference never writes weights
                warnings.simplefilter("ignore", UserWarning)
                tensor = torch.frombuffer(reader.view(sl.shm_name, base, spec.nbytes), dtype=spec.dtype)
            tensor = tensor.view(spec.shape)
            self._spare.update(self._writable({name: self._tensors[name]}))
            self._tensors[name], self._flat[name] = tensor, tensor.view(-1)
            self._shared_ptrs.add(tensor.data_ptr())
            self._adopted[name] = where
        elif held != where:
            raise InvalidWeights(
                f"slices[{i}].shm_offset: {name} lies at {held} per its other slices, this one says {where}"
            )
        if not self._coverage[name].add(offset, offset + count):
            raise InvalidWeights(
                f"slices[{i}].offset: {name} elements [{offset}, {offset + count}) already staged"
            )
        expected = SliceChecksum.of(sl)
        if self.verify_checksums and expected is not None:  # without one a peer verifies this share
            region = self._flat[name].view(torch.uint8)[offset * size : (offset + count) * size]
            verify_slice(
                expected,
                region.numpy(),
                where=f"slices[{i}]",
                what=f"{name} elements [{offset}, {offset + count}) in shared copy {sl.shm_name!r}",
            )
        self._bytes += nbytes

    def _stage_slice(
        self,
        i: int,
        name: str,
        dtype: int,
        shape: tuple[int, ...],
        offset: int,
        data,
        expected: SliceChecksum | None,
        verified_elsewhere: bool = False,
    ) -> None:
        spec = self._check_meta(i, name, dtype, shape)
        if name in self._adopted:
            raise InvalidWeights(f"slices[{i}].shm_adopt: {name} mixes copied and adopted slices")
        size = itemsize(spec.dtype)
        src = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
        nbytes = src.nbytes
        if nbytes % size:
            raise InvalidWeights(
                f"slices[{i}].data: {nbytes} bytes is not a whole number of {dtype_name(spec.dtype)}"
            )
        count = nbytes // size
        self._check_range(i, spec, offset, count)
        verify = self.verify_checksums and not verified_elsewhere
        if not self._coverage[name].add(offset, offset + count):
            raise InvalidWeights(
                f"slices[{i}].offset: {name} elements [{offset}, {offset + count}) already staged"
            )
        target = self._flat[name].view(torch.uint8)[offset * size : (offset + count) * size]
        what = f"{name} elements [{offset}, {offset + count})"
        if target.device.type == "cpu":
            if verify:  # checked on what landed in the staging tensor, block by block while it is hot
                verify_slice(expected, src, into=target.numpy(), where=f"slices[{i}]", what=what)
            else:
                np.copyto(target.numpy(), src if src.ndim == 1 else np.ascontiguousarray(src).reshape(-1))
        else:
            flat = np.ascontiguousarray(src).reshape(-1)
            if verify:
                verify_slice(expected, src, where=f"slices[{i}]", what=what)
            target.copy_(torch.from_numpy(flat.copy()), non_blocking=False)
        self._bytes += nbytes

    def _drop(self) -> None:
        # Keep the buffers for the next attempt: reallocating would fault every page again.
        self._spare.update(self._writable(self._tensors))
        self._reset()

    def _reset(self) -> None:
        self._version = None
        self._adopted = {}
        self._tensors = {}
        self._flat = {}
        self._coverage = {}
        self._bytes = 0
        self._staged_config = ""
