"""A disaggregated deployment's worker side of the router's two-phase request (CPU engine).

The router asks a prefill worker with `kv_transfer_params = {"do_remote_decode": true}` (and
max_tokens = 1, as it would ask vLLM); the worker prefills the prompt for transfer
(engine/disaggregated.py) and answers with the params that locate the KV:

    {"do_remote_prefill": true, "kv_id": ..., "kv_version": v, "host_id": ..., "remote_address":
     "host:port", "prefill_replica": ..., "prompt_tokens": L, "nbytes": N}

The router passes them, unchanged, in the decode request to a decode worker, which gets the KV:

- from shared memory when the prefill worker's `host_id` is its own (and `kv_transfer` is not
  "grpc"): it reads and unlinks the blob;
- over gRPC otherwise (FetchKV on the prefill worker's engine server, which streams the blob and
  drops it; `kv_transfer = "shm"` refuses this and recomputes);
- not at all when that fails (the prefill worker died, the blob expired or is corrupt, it is
  another prompt's): the decode worker recomputes the prompt itself, vLLM's
  kv_load_failure_policy = "recompute". The answer says which (`GenerateResponse.kv_transfer`).

KV made under a version this worker is about to commit (the weight-sync commit of a deployment's
workers reaches them in some order) waits, bounded, for that commit; KV of any other version is
recomputed by the engine under the version it serves.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.inference_router.engine.disaggregated import DisaggregatedEngine, KVHandle
from services.inference_router.engine.kv_transfer import (
    KVUnavailable,
    PromptKV,
    check_kv_id,
    decode,
    take_local,
)
from services.kit import errors

log = logging.getLogger("looprl.inference_router.replica")

FETCH_CHUNK_BYTES = 4 * 1024 * 1024
# How long a decode worker waits for the commit of a version a prefill worker already serves.
COMMIT_WAIT_S = 10.0


def parse_params(text: str) -> dict[str, Any]:
    """GenerateRequest.kv_transfer_params as a dict ({} when empty); INVALID_ARGUMENT naming the
    field when it is not a JSON object."""
    if not text:
        return {}
    try:
        params = json.loads(text)
    except ValueError as exc:
        raise errors.InvalidArgument(f"kv_transfer_params: not JSON ({exc})") from None
    if not isinstance(params, dict):
        raise errors.InvalidArgument("kv_transfer_params: must be a JSON object")
    return params


def handed_over(handle: KVHandle, host_id: str, address: str, replica: str) -> str:
    """The params a prefill worker answers with (GenerateResponse.kv_transfer_params)."""
    return json.dumps(
        {
            "do_remote_prefill": True,
            "kv_id": handle.kv_id,
            "kv_version": handle.version,
            "host_id": host_id,
            "remote_address": address,
            "prefill_replica": replica,
            "prompt_tokens": handle.prompt_tokens,
            "nbytes": handle.nbytes,
        }
    )


class KVReceiver:
    """How a decode worker gets handed-over KV: from shared memory or a prefill worker's server."""

    def __init__(self, host_id: str, transfer: str = "auto", max_message_bytes: int = 64 * 1024 * 1024):
        self.host_id = host_id
        self.transfer = transfer
        self.max_message_bytes = max_message_bytes
        self._stubs: dict[str, Any] = {}
        self._channels: list[Any] = []

    async def receive(self, params: dict[str, Any], prompt: list[int]) -> tuple[PromptKV | None, str]:
        """(the KV, "shm" | "grpc"), or (None, why it will be recomputed)."""
        try:
            kv_id = check_kv_id(str(params.get("kv_id", "")))
        except KVUnavailable as exc:
            return None, f"bad params: {exc}"
        local = params.get("host_id") == self.host_id and self.transfer != "grpc"
        if not local and self.transfer == "shm":
            return None, "prefill worker on another host (kv_transfer = shm)"
        try:
            if local:
                blob = await asyncio.to_thread(take_local, kv_id)
            else:
                blob = await self._fetch(str(params.get("remote_address", "")), kv_id)
            kv = await asyncio.to_thread(decode, blob, prompt)
        except KVUnavailable as exc:
            return None, str(exc)
        return kv, "shm" if local else "grpc"

    async def _fetch(self, address: str, kv_id: str) -> bytearray:
        import grpc

        if not address:
            raise KVUnavailable("no remote_address to fetch the KV from")
        stub = self._stubs.get(address)
        if stub is None:
            from services.kit.server import open_channel

            channel = open_channel(address, self.max_message_bytes)
            self._channels.append(channel)
            stub = self._stubs[address] = inference_pb2_grpc.InferenceEngineServiceStub(channel)
        out = bytearray()
        try:
            async for chunk in stub.FetchKV(inference_pb2.FetchKVRequest(kv_id=kv_id), timeout=30):
                out += chunk.data
        except grpc.aio.AioRpcError as exc:
            raise KVUnavailable(f"FetchKV from {address}: {exc.code().name}: {exc.details()}") from None
        return out

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._stubs.clear()


async def fetch_chunks(engine: Any, kv_id: str) -> AsyncIterator[inference_pb2.FetchKVResponse]:
    """FetchKV on a prefill worker: the blob in chunks, dropped from its store as it is handed out."""
    if not isinstance(engine, DisaggregatedEngine):
        raise errors.NotFound(f"kv_id: {kv_id!r}: this replica holds no handed-over KV")
    try:
        blob = await asyncio.to_thread(engine.store.take, kv_id)
    except KVUnavailable as exc:
        raise errors.NotFound(f"kv_id: {exc}") from None
    view = memoryview(blob)
    for start in range(0, len(view), FETCH_CHUNK_BYTES):
        yield inference_pb2.FetchKVResponse(data=bytes(view[start : start + FETCH_CHUNK_BYTES]))
