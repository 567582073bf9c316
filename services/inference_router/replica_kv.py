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
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.inference_router.engine.base import Engine, EngineRequest
from services.inference_router.engine.disaggregated import DisaggregatedEngine, KVHandle, KVRequest
from services.inference_router.engine.kv_transfer import (
    KVUnavailable,
    PromptKV,
    check_kv_id,
    decode,
    take_local,
)
from services.kit.config.recipe import DisaggregationSection
from services.kit.process.hosts import host_identity
from services.kit.rpc import errors

log = logging.getLogger("looprl.inference_router.replica")

FETCH_CHUNK_BYTES = 4 * 1024 * 1024
HANDED = ("shm", "grpc", "nixl")  # the decode continued from KV a prefill worker made
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


class WorkerKV:
    """A replica's side of the two-phase request: prefilling for transfer, and receiving handed-over
    KV (from shared memory or a prefill worker's server) to decode from."""

    def __init__(
        self,
        replica: str,
        address: str,
        section: DisaggregationSection,
        wait_for_commit: Callable[[int], Awaitable[None]],
        max_message_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.replica = replica
        self.address = address
        self.host_id = host_identity()
        self.transfer = section.kv_transfer
        self.wait_for_commit = wait_for_commit
        self.max_message_bytes = max_message_bytes
        self._stubs: dict[str, Any] = {}
        self._channels: list[Any] = []
        self.received = {"shm": 0, "grpc": 0}
        self.unavailable = 0  # handed-over KV it could not use: read failed, gone, corrupt
        self.last_unavailable = ""

    def figures(self) -> dict[str, int | str]:
        """What it received, for the replica's status."""
        return {
            "kv_received_shm": self.received["shm"],
            "kv_received_grpc": self.received["grpc"],
            "kv_unavailable": self.unavailable,
            "kv_last_unavailable": self.last_unavailable,
        }

    async def prefill(self, engine: Engine, request: EngineRequest, params: dict[str, Any]) -> str:
        """Prefill `request` for a decode worker; the params that locate its KV ("" when the engine
        could not hand it over: the decode worker then computes the prompt)."""
        if isinstance(engine, DisaggregatedEngine):
            return handed_over(
                await engine.prefill_for_transfer(request), self.host_id, self.address, self.replica
            )
        # vLLM: max_tokens 1 with do_remote_decode; its connector answers where the KV waits.
        request.kv_transfer_params = params
        [result] = await engine.generate([request])
        if not result.kv_transfer_params:
            return ""
        version = min((c.weight_version for c in result.completions), default=-1)
        return json.dumps(
            result.kv_transfer_params | {"looprl_kv_version": version, "prefill_replica": self.replica}
        )

    async def decode_request(
        self, engine: Engine, request: EngineRequest, params: dict[str, Any]
    ) -> tuple[EngineRequest, str]:
        """`request` continuing from the KV `params` locate, and how it came ("shm", "grpc",
        "nixl"), or `request` as it is and why the engine computes the prompt itself."""
        if not isinstance(engine, DisaggregatedEngine):  # vLLM: its KV connector loads the KV
            if params.get("looprl_kv_version") != engine.status().weight_version:
                return request, "another weight version"
            request.kv_transfer_params = params
            return request, "nixl"
        kv, how = await self.receive(params, request.prompt_token_ids)
        if kv is None:
            self.unavailable += 1
            self.last_unavailable = how
            log.info("replica %s recomputes a prompt: %s", self.replica, how)
        else:
            self.received[how] += 1
            if kv.version > engine.status().weight_version:
                await self.wait_for_commit(kv.version)
        fields = {
            f: getattr(request, f) for f in ("prompt_token_ids", "sampling", "session_id", "request_id")
        }
        return KVRequest(**fields, kv=kv), how

    @staticmethod
    def answer(request: EngineRequest, params: dict[str, Any], how: str) -> dict[str, str]:
        """GenerateResponse's kv_transfer and prefill_replica: how the decode got the prompt's KV,
        and from whom ("recompute": this worker computed the prompt itself)."""
        if not params.get("do_remote_prefill") or getattr(request, "recomputed", "") or how not in HANDED:
            return {"kv_transfer": "recompute"}
        return {"kv_transfer": how, "prefill_replica": str(params.get("prefill_replica", ""))}

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
            from services.kit.rpc.server import open_channel

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
