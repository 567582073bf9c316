"""Errors of the event bus (services.kit.bus.client and services.kit.bus.kv), in plain words."""

from __future__ import annotations


class BusError(RuntimeError):
    """Something on the bus failed in a way the caller should hear about in plain words."""


class BusUnavailable(BusError, ConnectionError):
    """No NATS server answered."""


class PayloadTooLarge(BusError, ValueError):
    """A message or KV value is larger than the server's max_payload; retrying will not help."""


class KVConflict(BusError):
    """A compare-and-set write lost: the key is no longer at the revision the caller read."""

    def __init__(self, bucket: str, key: str, expected: int, current: int | None) -> None:
        self.bucket, self.key, self.expected, self.current = bucket, key, expected, current
        now = "absent" if current is None else f"at revision {current}"
        super().__init__(
            f"KV {bucket}/{key}: expected revision {expected} but the key is {now} "
            "(written concurrently); re-read it and retry"
        )


class PoisonMessage(BusError, ValueError):
    """A delivered payload cannot be parsed; retrying will not help (term it)."""
