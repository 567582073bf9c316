"""Handing a committed weight version from a replica to its vLLM workers, one TP rank each.

The replica stages every rank's resharded rectangles in its own `WeightStager`s (verified as they
land, services/weights/stager.py). Committing version v hands each rank's complete
state dict to that rank's vLLM worker through vLLM's weight-transfer API
(`update_weights(update_info=[...])`, a list indexed by worker rank). What crosses vLLM's
engine-core process must survive its msgpack utility-call encoding without type information
(vllm/v1/serial_utils.py: tuples arrive as lists, tensors and arbitrary objects are refused
unless insecure serialization is on), so an update info holds only str, int, list, dict and
bytes; the tensor bytes travel beside it:

- "shm": the rank's tensors are copied once into a POSIX shared-memory segment owned by the
  replica; the update info names the segment and lists every tensor (name, dtype, shape, byte
  offset, byte length, hash64 of its bytes). The worker maps the segment and checks every hash.
- "cuda_ipc": the rank's tensors are already on its GPU (a stager on the device, fed by the CUDA
  IPC or NCCL weight transports); the update info carries one CUDA IPC handle per tensor
  (torch's `reduce_tensor`, pickled) and the worker copies device to device.

`manifest_of`/`read_update` are the two ends; `check_against` matches a manifest with the
worker's own parameters (its TP shard of vLLM's model) before anything is written, so a version
that does not fit leaves the served weights untouched.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch

from services.weights.checksum import hash64
from services.weights.errors import ChecksumMismatch, InvalidWeights
from services.weights.specs import dtype_name

UPDATE_FIELDS = ("version", "phase", "transport", "segment", "params", "handles")
PHASES = ("verify", "load")
_ALIGN = 256


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidWeights(f"update_info.params.dtype: unknown dtype {name!r}")
    return dtype


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()


@dataclass
class RankHandoff:
    """One rank's committed tensors, where its worker can read them, and the manifest saying so."""

    update_info: dict[str, Any]
    segment: shared_memory.SharedMemory | None = None
    keep: tuple[torch.Tensor, ...] = ()  # device tensors whose IPC handles the info carries

    def for_phase(self, phase: str) -> dict[str, Any]:
        return {**self.update_info, "phase": phase}

    def close(self) -> None:
        if self.segment is not None:
            try:
                self.segment.unlink()
            except FileNotFoundError:
                pass
            _close(self.segment)
            self.segment = None
        self.keep = ()


def manifest_of(
    version: int, state: Mapping[str, torch.Tensor], row_starts: Mapping[str, int] | None = None
) -> RankHandoff:
    """Place one rank's committed state where its worker can read it ("shm" for host tensors,
    "cuda_ipc" for device ones) and describe it with plain msgpack-native values. `row_starts`:
    the first vocabulary row of each vocabulary-parallel tensor (checked against vLLM's shard)."""
    tensors = {name: t.detach().contiguous() for name, t in state.items()}
    if not tensors:
        raise InvalidWeights("state: a rank handoff needs at least one tensor")
    on_device = {t.device.type for t in tensors.values()}
    if on_device == {"cpu"}:
        handoff = _shm_handoff(version, tensors)
    elif on_device == {"cuda"}:
        handoff = _ipc_handoff(version, tensors)
    else:
        raise InvalidWeights(f"state: tensors on {sorted(on_device)}; one rank's tensors share one device")
    for entry in handoff.update_info["params"]:
        if row_starts and entry["name"] in row_starts:
            entry["row_start"] = int(row_starts[entry["name"]])
    return handoff


def _entry(name: str, t: torch.Tensor, offset: int) -> dict[str, Any]:
    return {
        "name": name,
        "dtype": dtype_name(t.dtype),
        "shape": [int(d) for d in t.shape],
        "offset": int(offset),
        "nbytes": int(t.numel() * t.element_size()),
    }


def _segment_bytes(segment: shared_memory.SharedMemory) -> np.ndarray:
    if segment.buf is None:
        raise InvalidWeights(f"shared memory {segment.name!r} is closed")
    return np.frombuffer(segment.buf, dtype=np.uint8)


def _shm_handoff(version: int, tensors: Mapping[str, torch.Tensor]) -> RankHandoff:
    entries, pos = [], 0
    for name, t in tensors.items():
        entries.append(_entry(name, t, pos))
        pos += -(-entries[-1]["nbytes"] // _ALIGN) * _ALIGN
    segment = shared_memory.SharedMemory(create=True, size=max(pos, 1))
    try:
        view = _segment_bytes(segment)
        for entry, t in zip(entries, tensors.values(), strict=True):
            dst = view[entry["offset"] : entry["offset"] + entry["nbytes"]]
            np.copyto(dst, _bytes_of(t))
            entry["hash64"] = hash64(dst)  # of what landed in the segment, not of the source
        del view, dst
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    info = {
        "version": int(version),
        "phase": "verify",
        "transport": "shm",
        "segment": segment.name,
        "params": entries,
        "handles": [],
    }
    return RankHandoff(info, segment=segment)


def _ipc_handoff(version: int, tensors: Mapping[str, torch.Tensor]) -> RankHandoff:
    from torch.multiprocessing.reductions import reduce_tensor

    entries = [_entry(name, t, 0) for name, t in tensors.items()]
    handles = [pickle.dumps(reduce_tensor(t)) for t in tensors.values()]
    info = {
        "version": int(version),
        "phase": "verify",
        "transport": "cuda_ipc",
        "segment": "",
        "params": entries,
        "handles": handles,
    }
    return RankHandoff(info, keep=tuple(tensors.values()))


def check_update_info(info: Mapping[str, Any]) -> None:
    """The shape of an update info, field by field (what vLLM hands the worker back)."""
    unknown = sorted(set(info) - set(UPDATE_FIELDS))
    if unknown:
        raise InvalidWeights(f"update_info.{unknown[0]}: unknown field (known: {', '.join(UPDATE_FIELDS)})")
    if info.get("phase") not in PHASES:
        raise InvalidWeights(f"update_info.phase: must be one of {PHASES}, got {info.get('phase')!r}")
    if info.get("transport") not in ("shm", "cuda_ipc"):
        raise InvalidWeights(f"update_info.transport: 'shm' or 'cuda_ipc', got {info.get('transport')!r}")
    params = info.get("params")
    if not isinstance(params, list) or not params:
        raise InvalidWeights("update_info.params: a non-empty list of tensors")
    if info["transport"] == "cuda_ipc" and len(info.get("handles") or []) != len(params):
        raise InvalidWeights("update_info.handles: one CUDA IPC handle per entry of params")


class UpdateReader:
    """The worker's end: the tensors an update info describes, verified before they are used."""

    def __init__(self, info: Mapping[str, Any], device: torch.device | str = "cpu") -> None:
        check_update_info(info)
        self.info = info
        self.device = torch.device(device)
        self._segment: shared_memory.SharedMemory | None = None

    def tensors(self, verify: bool = True) -> dict[str, torch.Tensor]:
        """name -> tensor (a view of the segment, or the sender's device tensor)."""
        if self.info["transport"] == "shm":
            return self._shm_tensors(verify)
        return self._ipc_tensors()

    def _shm_tensors(self, verify: bool) -> dict[str, torch.Tensor]:
        if self._segment is None:
            try:
                self._segment = shared_memory.SharedMemory(name=self.info["segment"])
            except FileNotFoundError:
                raise InvalidWeights(
                    f"update_info.segment: shared memory {self.info['segment']!r} does not exist"
                ) from None
        buf = _segment_bytes(self._segment)
        out: dict[str, torch.Tensor] = {}
        for i, p in enumerate(self.info["params"]):
            start, nbytes = int(p["offset"]), int(p["nbytes"])
            if start < 0 or start + nbytes > buf.size:
                raise InvalidWeights(f"update_info.params[{i}].offset: {p['name']} lies outside the segment")
            raw = buf[start : start + nbytes]
            if verify and hash64(raw) != int(p["hash64"]):
                del raw, buf, out  # no view may outlive the failure: the segment must unmap
                raise ChecksumMismatch(
                    f"update_info.params[{i}].hash64: {p['name']} changed after the replica wrote it"
                )
            dtype = _dtype(p["dtype"])
            out[p["name"]] = torch.from_numpy(raw).view(dtype).view(tuple(p["shape"]))
        return out

    def _ipc_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for p, handle in zip(self.info["params"], self.info["handles"], strict=True):
            fn, args = pickle.loads(handle)
            t = fn(*args)
            if list(t.shape) != list(p["shape"]) or dtype_name(t.dtype) != p["dtype"]:
                raise InvalidWeights(f"update_info.handles: {p['name']} does not match its entry")
            out[p["name"]] = t
        return out

    def close(self) -> None:
        if self._segment is not None:
            _close(self._segment)
            self._segment = None


def _close(segment: shared_memory.SharedMemory) -> None:
    """Unmap a segment; views still alive (a traceback's frames) keep it mapped until collected."""
    try:
        segment.close()
    except BufferError:
        import gc

        gc.collect()
        try:
            segment.close()
        except BufferError:
            pass


def vocab_rows_start(module: Any) -> int | None:
    """The first vocabulary row a vLLM VocabParallelEmbedding/ParallelLMHead shard holds."""
    indices = getattr(module, "shard_indices", None)
    start = getattr(indices, "org_vocab_start_index", None)
    return None if start is None else int(start)


def check_against(
    params: Mapping[str, torch.Tensor], manifest: list[Mapping[str, Any]], vocab_starts: Mapping[str, int]
) -> None:
    """Every manifest entry names one of the worker's parameters, in its dtype, and fits it: the
    same shape, or (vocabulary-parallel tensors, padded by vLLM) the same row width with no more
    rows than the padded shard, starting where the shard starts (`vocab_starts`, per name)."""
    for i, p in enumerate(manifest):
        name, shape = p["name"], tuple(p["shape"])
        target = params.get(name)
        if target is None:
            raise InvalidWeights(f"update_info.params[{i}].name: {name!r} is not a parameter of this worker")
        if dtype_name(target.dtype) != p["dtype"]:
            raise InvalidWeights(
                f"update_info.params[{i}].dtype: {name} is {dtype_name(target.dtype)} here, got {p['dtype']}"
            )
        if tuple(target.shape) == shape:
            continue
        padded = (
            len(shape) == target.dim()
            and shape[1:] == tuple(target.shape[1:])
            and shape[0] <= target.shape[0]
        )
        if not padded:
            raise InvalidWeights(
                f"update_info.params[{i}].shape: {name} is {list(target.shape)} here, got {list(shape)}"
            )
        expected = p.get("row_start")
        start = vocab_starts.get(name)
        if expected is not None and start is not None and int(expected) != start:
            raise InvalidWeights(
                f"update_info.params[{i}].row_start: {name} starts at vocabulary row {start} here "
                f"(vLLM pads the vocabulary), the sender's shard at {expected}"
            )


def load_into(params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> int:
    """Copy checked tensors into the worker's parameters (the first rows of a padded shard)."""
    total = 0
    with torch.no_grad():
        for name, src in tensors.items():
            dst = params[name].data
            rows = dst if tuple(dst.shape) == tuple(src.shape) else dst[: src.shape[0]]
            rows.copy_(src.to(dst.device, non_blocking=True))
            total += src.numel() * src.element_size()
    return total
