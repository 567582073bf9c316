"""A prompt's KV cache as a prefill worker hands it to a decode worker (CPU engine).

One blob per prompt: a fixed 512-byte header (magic, then JSON: the weight version that made the
KV, the prompt's length and hash, the tensors' dtype and shape, a checksum of the payload), then
the keys and values of every layer ([layers, kv_heads, prompt_tokens, head_dim] each, the
engine's dtype) and the float32 logits of the prompt's last position, from which the decode worker
samples the first token. A prefill worker writes it to a file under the host's shared-memory
directory (`KVStore`); a decode worker on that host reads the file and unlinks it, one on another
host reads the same bytes over gRPC (InferenceEngineService.FetchKV, which unlinks it after the
last chunk). Every blob is read once. A blob nobody read is unlinked `ttl_s` after it was made,
and a restarted worker removes the blobs its dead predecessor left. Names are checked before any
file is opened (`looprl-kv-<pid>-<32 hex>`: no paths), and a blob is used only for the prompt it
was made from (its hash) and only if its checksum holds; otherwise the decode worker recomputes.
"""

from __future__ import annotations

import json
import os
import re
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from services.kit.process.hosts import shm_dir

PREFIX = "looprl-kv-"
MAGIC = b"LKV1"
HEADER_BYTES = 512
_NAME = re.compile(r"^looprl-kv-(\d+)-[0-9a-f]{32}$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVUnavailable(Exception):
    """The KV cannot be used (gone, corrupt, or another prompt's); the message says why."""


def prompt_hash(prompt: list[int]) -> str:
    return xxhash.xxh3_64_hexdigest(struct.pack(f"<{len(prompt)}i", *prompt))


def check_kv_id(kv_id: str) -> str:
    if not _NAME.match(kv_id):
        raise KVUnavailable(f"kv_id: {kv_id!r} is not a KV blob name")
    return kv_id


@dataclass
class PromptKV:
    """What a decode worker continues from: keys and values [layers, kv_heads, L, head_dim], the
    logits of the prompt's last position [vocab], and the weight version that made them."""

    keys: torch.Tensor
    values: torch.Tensor
    logits: torch.Tensor
    version: int

    @property
    def prompt_tokens(self) -> int:
        return int(self.keys.shape[2])


def encode(
    keys: torch.Tensor, values: torch.Tensor, logits: torch.Tensor, version: int, prompt: list[int]
) -> bytearray:
    """The blob of one prompt's KV (keys/values may be views into an engine's cache)."""
    dtype = next((name for name, t in _DTYPES.items() if t == keys.dtype), None)
    if dtype is None or values.dtype != keys.dtype or keys.shape != values.shape or keys.dim() != 4:
        raise ValueError(f"encode: keys/values must be equal 4-D tensors of {list(_DTYPES)}")
    kv_bytes = keys.numel() * keys.element_size()
    vocab = int(logits.numel())
    out = bytearray(HEADER_BYTES + 2 * kv_bytes + 4 * vocab)
    payload = memoryview(out)[HEADER_BYTES:]
    flat = torch.frombuffer(payload, dtype=torch.uint8)
    flat[:kv_bytes].view(keys.dtype).view(keys.shape).copy_(keys)
    flat[kv_bytes : 2 * kv_bytes].view(keys.dtype).view(keys.shape).copy_(values)
    flat[2 * kv_bytes :].view(torch.float32).copy_(logits.reshape(-1).float())
    header = json.dumps(
        {
            "version": int(version),
            "prompt_tokens": len(prompt),
            "prompt_hash": prompt_hash(prompt),
            "dtype": dtype,
            "shape": list(keys.shape),
            "vocab": vocab,
            "checksum": xxhash.xxh3_64_hexdigest(payload),
        }
    ).encode()
    if 8 + len(header) > HEADER_BYTES:
        raise ValueError("encode: header too long")
    out[:8] = MAGIC + struct.pack("<I", len(header))
    out[8 : 8 + len(header)] = header
    return out


def decode(blob: bytes | bytearray | memoryview, prompt: list[int]) -> PromptKV:
    """The KV in `blob`, if it is intact and was made from `prompt`; else KVUnavailable."""
    view = memoryview(blob)
    if len(view) < HEADER_BYTES or bytes(view[:4]) != MAGIC:
        raise KVUnavailable("not a KV blob")
    (length,) = struct.unpack("<I", view[4:8])
    try:
        header = json.loads(bytes(view[8 : 8 + length]))
        dtype = _DTYPES[header["dtype"]]
        layers, heads, tokens, dim = (int(x) for x in header["shape"])
        vocab, version = int(header["vocab"]), int(header["version"])
    except (ValueError, KeyError, TypeError) as exc:
        raise KVUnavailable(f"unreadable KV header ({exc})") from None
    if tokens != len(prompt) or header.get("prompt_hash") != prompt_hash(prompt):
        raise KVUnavailable("the KV was made from another prompt")
    payload = view[HEADER_BYTES:]
    kv_bytes = layers * heads * tokens * dim * dtype.itemsize
    if len(payload) != 2 * kv_bytes + 4 * vocab:
        raise KVUnavailable(
            f"KV blob holds {len(payload)} payload bytes, its header says {2 * kv_bytes + 4 * vocab}"
        )
    if xxhash.xxh3_64_hexdigest(payload) != header.get("checksum"):
        raise KVUnavailable("KV blob checksum mismatch")
    flat = torch.frombuffer(payload, dtype=torch.uint8)
    shape = (layers, heads, tokens, dim)
    return PromptKV(
        keys=flat[:kv_bytes].view(dtype).view(shape),
        values=flat[kv_bytes : 2 * kv_bytes].view(dtype).view(shape),
        logits=flat[2 * kv_bytes :].view(torch.float32),
        version=version,
    )


def take_local(kv_id: str, directory: Path | None = None) -> bytearray:
    """Read a blob a prefill worker on this host wrote, and unlink it (each blob is read once)."""
    path = (directory or shm_dir()) / check_kv_id(kv_id)
    try:
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(data)
    except FileNotFoundError:
        raise KVUnavailable(f"KV {kv_id} is gone (read already, expired, or on another host)") from None
    path.unlink(missing_ok=True)
    return data


class KVStore:
    """A prefill worker's handed-over KV, one file each under the host's shared-memory directory,
    until a decode worker takes it or it expires."""

    def __init__(self, ttl_s: float = 60.0, directory: Path | None = None) -> None:
        self.ttl_s = ttl_s
        self.directory = directory or shm_dir()
        self._expiry: dict[str, float] = {}
        self._lock = threading.Lock()
        self.expired = 0
        self._remove_orphans()

    def put(self, blob: bytes | bytearray) -> str:
        """Write a blob; its kv_id (a decode worker's handle on it)."""
        kv_id = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        tmp = self.directory / f".{kv_id}.tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, self.directory / kv_id)  # a reader never sees half a blob
        with self._lock:
            self._expiry[kv_id] = time.monotonic() + self.ttl_s
        self.sweep()
        return kv_id

    def take(self, kv_id: str) -> bytearray:
        """A blob of this store, read once (FetchKV): unlinked as it is handed out."""
        with self._lock:
            known = self._expiry.pop(check_kv_id(kv_id), None) is not None
        if not known:
            raise KVUnavailable(f"KV {kv_id} is not held here (read already, or expired)")
        return take_local(kv_id, self.directory)

    def sweep(self) -> int:
        """Forget the blobs a decode worker on this host took (their file is gone), unlink those
        nobody took in time; how many expired."""
        now = time.monotonic()
        with self._lock:
            taken = [k for k in self._expiry if not (self.directory / k).exists()]
            due = [k for k, t in self._expiry.items() if t <= now and k not in taken]
            for k in taken + due:
                del self._expiry[k]
        for k in due:
            (self.directory / k).unlink(missing_ok=True)
        self.expired += len(due)
        return len(due)

    @property
    def held(self) -> int:
        return len(self._expiry)

    def close(self) -> None:
        with self._lock:
            names, self._expiry = list(self._expiry), {}
        for k in names:
            (self.directory / k).unlink(missing_ok=True)

    def _remove_orphans(self) -> None:
        """Blobs of a process that no longer exists (a prefill worker that died) and are older
        than the TTL: nobody will take them."""
        cutoff = time.time() - self.ttl_s
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return
        for entry in entries:
            match = _NAME.match(entry.name)
            if match is None or int(match.group(1)) == os.getpid():
                continue
            try:
                if entry.stat().st_mtime > cutoff:
                    continue
                os.kill(int(match.group(1)), 0)
            except ProcessLookupError:
                Path(entry.path).unlink(missing_ok=True)
            except OSError:
                continue
