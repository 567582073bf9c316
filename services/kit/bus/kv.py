"""JetStream key-value buckets: get / put / compare-and-set update / items / watch (see services.kit.bus.client)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from services.kit.bus.errors import KVConflict, PayloadTooLarge


@dataclass(frozen=True)
class KVEntry:
    key: str
    value: bytes
    revision: int
    deleted: bool = False


class KV:
    """A JetStream KV bucket. Keys: letters, digits and -/_=. ('.' separates tokens for watch)."""

    def __init__(self, bucket: str, store: KeyValue, js: JetStreamContext) -> None:
        self.bucket = bucket
        self._store = store
        self._js = js

    async def get(self, key: str) -> bytes | None:
        """The current value, or None when the key is absent or deleted."""
        entry = await self.entry(key)
        return None if entry is None else entry.value

    async def entry(self, key: str) -> KVEntry | None:
        """The current value with its revision (for update), or None when absent or deleted."""
        try:
            e = await self._store.get(_check_key(key))
        except nats.js.errors.KeyNotFoundError:
            return None
        return KVEntry(key, e.value or b"", e.revision or 0)

    async def put(self, key: str, value: bytes) -> int:
        """Write unconditionally; returns the new revision. PayloadTooLarge past max_payload."""
        try:
            return await self._store.put(_check_key(key), value)
        except nats.errors.MaxPayloadError as err:
            raise PayloadTooLarge(
                f"KV {self.bucket}/{key}: {len(value)} bytes, over the server's max_payload"
            ) from err

    async def create(self, key: str, value: bytes) -> int:
        """Write only if the key does not exist; KVConflict otherwise."""
        try:
            return await self._store.create(_check_key(key), value)
        except nats.js.errors.KeyWrongLastSequenceError as err:
            current = await self.entry(key)
            raise KVConflict(self.bucket, key, 0, current.revision if current else None) from err

    async def update(self, key: str, value: bytes, last_revision: int) -> int:
        """Compare-and-set: write only if the key is still at last_revision; KVConflict otherwise."""
        try:
            return await self._store.update(_check_key(key), value, last=last_revision)
        except nats.js.errors.KeyWrongLastSequenceError as err:
            current = await self.entry(key)
            raise KVConflict(self.bucket, key, last_revision, current.revision if current else None) from err

    async def delete(self, key: str) -> None:
        await self._store.delete(_check_key(key))

    async def items(self, pattern: str = ">") -> dict[str, bytes]:
        """The current value of every key matching a NATS pattern ('>' all, '*' one token), by key;
        deleted and purged keys are left out.

        The keys come from the server's own count of subjects, in one request: a consumer listing the
        bucket (nats-py's `keys()`) can list a key written meanwhile twice, or not at all when a write
        replaces the message it was about to deliver, and a run missed would escape its tenant's
        quota."""
        prefix = f"$KV.{self.bucket}."
        info = await self._js.stream_info(f"KV_{self.bucket}", subjects_filter=prefix + pattern)
        out: dict[str, bytes] = {}
        for subject in sorted(info.state.subjects or {}):
            entry = await self.entry(subject.removeprefix(prefix))
            if entry is not None:
                out[entry.key] = entry.value
        return out

    def watch(self, keys: str = ">", *, include_history: bool = False) -> KVWatch:
        """Changes to keys matching a NATS pattern ('>' all, 'run1.>' all under run1., 'a.*').

        Yields the current value of each matching key first, then every later change (deletes
        as KVEntry(deleted=True)). Use as `async with kv.watch("x.>") as w: async for e in w:`.
        """
        return KVWatch(self._store, keys, include_history)


class KVWatch:
    """An async iterator of KVEntry; stop() or leave the `async with` block to end it."""

    def __init__(self, store: KeyValue, keys: str, include_history: bool) -> None:
        self._store = store
        self._keys = keys
        self._include_history = include_history
        self._watcher: KeyValue.KeyWatcher | None = None

    async def start(self) -> KVWatch:
        if self._watcher is None:
            self._watcher = await self._store.watch(self._keys, include_history=self._include_history)
        return self

    async def stop(self) -> None:
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
                pass

    async def __aenter__(self) -> KVWatch:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def __aiter__(self) -> AsyncIterator[KVEntry]:
        return self

    async def __anext__(self) -> KVEntry:
        await self.start()
        assert self._watcher is not None
        async for e in self._watcher:
            if e is None:
                # nats-py's "initial values delivered" marker; not a change.
                continue
            deleted = e.operation in ("DEL", "PURGE")
            return KVEntry(e.key, b"" if deleted else (e.value or b""), e.revision or 0, deleted)
        raise StopAsyncIteration


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not key or key.startswith(".") or key.endswith("."):
        raise ValueError(f"KV key {key!r} is not valid")
    for ch in key:
        if not (ch.isascii() and (ch.isalnum() or ch in "-/_=.")):
            raise ValueError(f"KV key {key!r} is not valid: character {ch!r} (use letters, digits, -/_=.)")
    return key
