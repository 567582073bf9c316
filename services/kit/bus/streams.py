"""Provisioning the event bus: the JetStream streams and KV buckets named in services.kit.bus.subjects,
created or brought to their configuration (what `Bus.ensure_streams` does)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api

from services.kit.bus import subjects as names
from services.kit.bus.errors import BusError, BusUnavailable

log = logging.getLogger(__name__)

DEFAULT_DUPLICATE_WINDOW_S = 120.0


async def ensure_streams(
    js: JetStreamContext,
    server: str,
    streams: Sequence[names.StreamSpec] = names.STREAMS,
    buckets: Sequence[names.BucketSpec] = names.BUCKETS,
    *,
    duplicate_window_s: float = DEFAULT_DUPLICATE_WINDOW_S,
    replicas: int = 1,
) -> None:
    """Create the streams and KV buckets, or bring existing ones to this configuration.

    Idempotent: several services may call it concurrently at startup. A stream whose
    retention differs cannot be changed in place and raises BusError saying so.
    """
    try:
        for spec in streams:
            await _ensure_stream(js, spec, duplicate_window_s, replicas)
        for bucket in buckets:
            await _ensure_bucket(js, bucket, replicas)
    except nats.js.errors.ServiceUnavailableError as err:
        raise BusUnavailable(
            f"NATS at {server} does not answer "
            "JetStream requests; start nats-server with JetStream enabled (-js)"
        ) from err


async def _ensure_stream(
    js: JetStreamContext, spec: names.StreamSpec, duplicate_window_s: float, replicas: int
) -> None:
    want = api.StreamConfig(
        name=spec.name,
        description=spec.description or None,
        subjects=list(spec.subjects),
        retention=api.RetentionPolicy(spec.retention.value),
        storage=api.StorageType.FILE,
        max_age=spec.max_age_s or 0,
        max_bytes=spec.max_bytes or -1,
        duplicate_window=duplicate_window_s,
        num_replicas=replicas,
    )
    try:
        info = await js.stream_info(spec.name)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(want)
            log.info("created stream %s (%s)", spec.name, ", ".join(spec.subjects))
            return
        except nats.js.errors.BadRequestError:
            # Lost a creation race with another service: fall through and compare.
            info = await js.stream_info(spec.name)
    have = info.config
    # The server's answer carries plain strings where the request used enums.
    have_retention = str(getattr(have.retention, "value", have.retention) or "limits")
    if have_retention != spec.retention.value:
        raise BusError(
            f"stream {spec.name} exists with retention {have_retention} but {spec.retention.value} "
            "is required; retention cannot change in place (delete the stream to recreate it)"
        )
    if _stream_differs(have, want):
        merged = have.evolve(
            description=want.description,
            subjects=want.subjects,
            max_age=want.max_age,
            max_bytes=want.max_bytes,
            duplicate_window=want.duplicate_window,
        )
        await js.update_stream(merged)
        log.info("updated stream %s", spec.name)


async def _ensure_bucket(js: JetStreamContext, spec: names.BucketSpec, replicas: int) -> None:
    try:
        await js.key_value(spec.name)
        return
    except nats.js.errors.BucketNotFoundError:
        pass
    await js.create_key_value(
        bucket=spec.name,
        description=spec.description or None,
        history=spec.history,
        ttl=spec.ttl_s,
        storage=api.StorageType.FILE,
        replicas=replicas,
    )
    log.info("created KV bucket %s", spec.name)


def _stream_differs(have: api.StreamConfig, want: api.StreamConfig) -> bool:
    def close(a: float | None, b: float | None) -> bool:
        return abs((a or 0.0) - (b or 0.0)) < 1e-6

    return (
        sorted(have.subjects or []) != sorted(want.subjects or [])
        or not close(have.max_age, want.max_age)
        or not close(have.duplicate_window, want.duplicate_window)
        or (have.max_bytes or -1) != (want.max_bytes or -1)
        or (have.description or None) != (want.description or None)
    )
