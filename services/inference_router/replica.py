"""One inference replica: an engine (CPU, TP group, or vLLM) inside a Ray actor, plus its own gRPC server.

`ReplicaCore` wraps ONE engine for one replica of a deployment. The router calls it through Ray
with serialized protos (`generate`, `generate_stream`, `status`, ...); the same replica ALSO serves
InferenceEngineService on its host's address:<free port> (Generate, Status, Pause, Resume,
StageWeights, CommitWeights, AbortWeights, RollbackWeights, ProbeSharedMemory) so weight-sync can deliver weights to it and
benchmarks can call it directly, with health, reflection and a /metrics port of its own
(replica_server.py). StageWeights is registered to receive raw bytes
(`add_engine_servicer`) and decoded without protobuf copying the payload; a bucket for another TP
rank is forwarded as received.

Weights: a replica built without a model path has no model and is NOT ready. The first bucket of
the first version carries the HF config.json (model_config_json); the replica builds its engine
from it, stages every bucket (its own rank's slices locally, rank r's slices to TP worker r; a vLLM
replica stages every rank here, one stager per rank, in vLLM's fused layout) in a `WeightStager`
beside the serving version (checksums verified), and CommitWeights swaps the new version in
atomically between two decode steps (vLLM: once every rank is complete, through vLLM's
weight-transfer API, engine/vllm_engine.py). The weights a commit retires go back to the
stager as the rollback point: RollbackWeights (a canary whose new version failed its check) swaps
them back in, again between two steps, and the status says it was a rollback, not a restart
(`rolled_back_version`). A replica with a model path loads version 0 from it at start.
A request the router sends ahead of its version (GenerateRequest.version_wait_ms) waits here for
the commit, so that generation starts with it; a canary deployment's replica does not hold
(weight-sync must check a version on it before anything samples from it) and says so in its status.
How each engine kind stages, commits, rolls back and aborts is its `WeightLifecycle` (weights.py),
built together with the engine.

A worker of a disaggregated deployment (spec.disaggregation) runs a DisaggregatedEngine on the cpu
backend (engine/disaggregated.py) and answers the router's two-phase request through its
`WorkerKV` (replica_kv.py): a Generate carrying kv_transfer_params is a prefill for transfer or a
decode from handed-over KV; FetchKV hands a prompt's KV to a decode worker on another host.

`ReplicaCore` is the plain class (usable in-process); `InferenceReplica` (replica_actor.py,
`InferenceReplica.options(...).remote(spec=..., replica=...)`) is it as a Ray async actor.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import torch
from opentelemetry import trace

from looprl.inference.v1 import inference_pb2, inference_pb2_grpc
from services.inference_router.adapters import Adapters
from services.inference_router.engine.base import Engine, EngineRequest, SamplingParams
from services.inference_router.engine.scheduler import SchedulerLimits
from services.inference_router.replica_kv import COMMIT_WAIT_S, WorkerKV, fetch_chunks, parse_params
from services.inference_router.replica_server import ReplicaServer
from services.inference_router.replica_status import ReplicaStatus
from services.inference_router.weights import LocalWeights, RankStagedWeights, TPGroupWeights, WeightLifecycle
from services.kit.config.recipe import DeploymentSpec
from services.kit.process import gc_freeze
from services.kit.process.hosts import host_identity
from services.kit.rpc import errors, tls
from services.kit.rpc.interceptors import ServerInterceptor
from services.kit.telemetry import tracing as telemetry
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, rank_params
from services.weights import add_engine_servicer
from services.weights.probe import read_probe
from services.weights.stager import WeightStager
from services.weights.wire import decode_stage_request

log = logging.getLogger("looprl.inference_router.replica")
_tracer = trace.get_tracer("looprl.inference_router.replica")


def serving_layout(spec: DeploymentSpec) -> Layout:
    """How a replica of `spec` holds its weights: HF names at tp=1 on CPU, fused names under TP and on
    vLLM (its own layout)."""
    naming = "fused" if spec.tensor_parallel > 1 or spec.backend == "vllm" else "hf"
    return Layout(tp_size=spec.tensor_parallel, naming=naming, dtype=spec.serving_dtype)


def _bind_host(host: str) -> str:
    """`host`, with "node" resolved to the address of the Ray node this process runs on (the host's
    primary address outside Ray), which weight-sync and the router reach from other hosts."""
    if host != "node":
        return host
    import ray

    if ray.is_initialized():
        return ray.util.get_node_ip_address()
    from services.kit.process.hosts import primary_address

    return primary_address()


def _config_at(path: str) -> ModelConfig:
    from pathlib import Path

    from services.modeling.qwen2 import CONFIG_FILE

    return ModelConfig.from_hf_dict(json.loads((Path(path) / CONFIG_FILE).read_text()))


def engine_request(req: inference_pb2.GenerateRequest, adapter: str = "") -> EngineRequest:
    return EngineRequest(
        prompt_token_ids=list(req.prompt_token_ids),
        sampling=SamplingParams.from_proto(req.sampling),
        session_id=req.session_id,
        request_id=req.request_id,
        adapter=adapter,
    )


class ReplicaCore:
    """The replica's logic; `InferenceReplica` is this class as a Ray actor."""

    def __init__(
        self,
        spec: DeploymentSpec | None = None,
        replica: str = "",
        host: str = "127.0.0.1",
        num_threads: int = 0,
        stop_token_ids: tuple[int, ...] = (),
        tracing: Mapping[str, str] | None = None,
        tls_credentials: dict[str, Any] | None = None,
    ) -> None:
        """`spec`: the deployment this replica serves, as the recipe declares it; `host`: the address
        its gRPC server binds and reports ("node": the Ray node's); `num_threads`: torch threads (0
        leaves torch's default, which Ray sets from num_cpus); `stop_token_ids`: the default stops."""
        # Spans of this replica (its gRPC server, generation over Ray) go where the router's go.
        telemetry.setup_from_settings("inference-replica", tracing)
        if tls_credentials is not None:
            # The router's identity (services/kit/rpc/tls.py): weight-sync and the router verify it.
            tls.adopt(tls_credentials)
        self.spec = spec or DeploymentSpec()
        self.layout = serving_layout(self.spec)
        self.host = host
        self.stop_token_ids = tuple(stop_token_ids)
        self.name = replica or f"{self.spec.name}-r0"
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.config: ModelConfig | None = None
        self.engine: Engine | None = None
        self.weights: WeightLifecycle | None = None  # built with the engine
        self.adapters: Adapters | None = None  # LoRA runs' adapters over the base (max_loras > 0)
        self._server: grpc.aio.Server | None = None
        self._doors: ReplicaServer | None = None  # health, reflection, /metrics
        self._address = ""
        self._start_lock: asyncio.Lock | None = None
        self._build_lock: asyncio.Lock | None = None
        self._paused = False
        self._weights_lock: asyncio.Lock | None = None  # commit and rollback never interleave
        self.rolled_back_version = -1  # the newest version a rollback undid (-1: none)
        self._stage_locks: dict[int | str, asyncio.Lock] = {}  # per rank, and per adapter
        # Set (and replaced) by each commit: requests held for a version wait on it.
        self._committed: asyncio.Event | None = None
        self._kv: WorkerKV | None = None  # a disaggregated deployment's worker side

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Start the gRPC server (and load the model path, if any); idempotent. Returns the address."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._server is None:
                await self._serve()
                if self.spec.model_path and self.spec.backend == "vllm":
                    await self._ensure_engine(_config_at(self.spec.model_path))  # vLLM reads the path
                elif self.spec.model_path:
                    await self._load_model_path(self.spec.model_path)
        return self._address

    async def _serve(self) -> None:
        server = grpc.aio.server(
            interceptors=[
                ServerInterceptor(f"replica/{self.name}", lambda: None, authorize=tls.current() is not None)
            ],
            options=[*tls.message_limits(256 * 1024 * 1024), ("grpc.so_reuseport", 0)],
        )
        add_engine_servicer(server, _EngineServicer(self))
        self._doors = ReplicaServer(server, self.spec.name, self.name)
        host = _bind_host(self.host)
        port = tls.add_port(server, f"{host}:0")
        await server.start()
        await self._doors.start(host)
        self._server = server
        self._address = f"{host}:{port}"
        log.info(
            "replica %s serving InferenceEngineService on %s, /metrics on %s",
            self.name,
            self._address,
            self._doors.metrics_address,
        )

    async def _load_model_path(self, path: str) -> None:
        from pathlib import Path

        from services.modeling.qwen2 import load_safetensors_dir

        state = await asyncio.to_thread(load_safetensors_dir, Path(path))
        await self.load_state_dict(0, state, config=_config_at(path))

    async def shutdown(self) -> None:
        if self._doors is not None:
            await self._doors.stop()
        if self.engine is not None:
            await self.engine.close()
        if self._kv is not None:
            await self._kv.close()
        if self._server is not None:
            await self._server.stop(grace=1.0)
            self._server = None

    async def _ensure_engine(self, config: ModelConfig) -> Engine:
        if self._build_lock is None:
            self._build_lock = asyncio.Lock()
        async with self._build_lock:
            if self.engine is not None:
                if config.to_dict() != self.config.to_dict():  # type: ignore[union-attr]
                    raise errors.InvalidArgument(
                        "model_config_json: differs from the model this replica serves"
                    )
                return self.engine
            s, layout = self.spec, self.layout
            try:
                layout.check(config)
            except ValueError as exc:
                raise errors.InvalidArgument(f"model_config_json: {exc}") from None
            if config.lora is not None:
                raise errors.FailedPrecondition(
                    "adapter: a LoRA run's replica serves its adapter over a base it loads from "
                    "model_path, and has none"
                )
            if s.max_loras and (s.tensor_parallel > 1 or config.generic):
                raise errors.InvalidArgument(
                    "max_loras: LoRA adapters are served by fast-path deployments of tensor_parallel = 1"
                )
            limits = SchedulerLimits(
                max_waiting_requests=s.max_queued_requests, default_stop_token_ids=self.stop_token_ids
            )
            if s.backend == "vllm":
                from services.inference_router.engine.vllm_engine import VLLMEngine

                engine = await VLLMEngine.create(
                    config, s, self.stop_token_ids, side_channel_host=_bind_host(self.host)
                )
                # Each TP rank's rectangles are staged here, then handed to its vLLM worker.
                stagers = [
                    WeightStager(rank_params(config, layout, r), rank=r) for r in range(s.tensor_parallel)
                ]
                weights: WeightLifecycle = RankStagedWeights(engine, stagers, layout)
                if s.max_loras:  # vLLM loads each adapter version by name from a PEFT directory
                    self.adapters = Adapters(engine, config, layout, s.max_loras)  # type: ignore[arg-type]
            elif config.generic:
                from services.inference_router.engine.generic import GenericEngine

                engine = GenericEngine.create(
                    config,
                    None,
                    dtype=layout.dtype,
                    max_batch_size=s.max_batch_size,
                    max_model_len=s.max_model_len,
                    limits=limits,
                )
                weights = LocalWeights(engine, WeightStager(rank_params(config, layout, 0)))
            elif s.tensor_parallel > 1:
                from services.inference_router.engine.tp import TPEngine

                engine = await TPEngine.create(
                    config,
                    layout,
                    max_batch_size=s.max_batch_size,
                    max_model_len=s.max_model_len,
                    limits=limits,
                )
                weights = TPGroupWeights(engine)
            else:
                from services.inference_router.engine.cpu import CPUEngine
                from services.inference_router.engine.disaggregated import DisaggregatedEngine

                engine = (DisaggregatedEngine if s.disaggregation is not None else CPUEngine).create(
                    config,
                    None,
                    layout=layout,
                    max_batch_size=s.max_batch_size,
                    max_model_len=s.max_model_len,
                    limits=limits,
                )
                weights = LocalWeights(engine, WeightStager(rank_params(config, layout, 0)))
                if s.max_loras:
                    self.adapters = Adapters(engine, config, layout, s.max_loras)
            self.config, self.engine, self.weights = config, engine, weights
            if self._paused:
                engine.pause()
            gc_freeze.freeze_startup_objects()
            return engine

    @property
    def _receiving_ranks(self) -> int:
        """Ranks weight-sync delivers to: every TP rank (a vLLM worker or a TP worker actor)."""
        return self.spec.tensor_parallel

    # ------------------------------------------------------------------ weights
    async def load_state_dict(
        self, version: int, state_dict: Mapping[str, torch.Tensor], config: ModelConfig | dict | None = None
    ) -> int:
        """Install a full HF state dict (or this tp=1 replica's shard) as `version` (tests, model paths)."""
        if isinstance(config, dict):
            config = ModelConfig.from_dict(config)
        config = config or self.config
        if config is None:
            raise errors.FailedPrecondition("config: this replica has no model yet; pass its config")
        engine = await self._ensure_engine(config)
        assert self.weights is not None
        try:
            await self.weights.install(version, state_dict, config)
        except ValueError as exc:
            raise errors.InvalidArgument(f"weights: {exc}") from None
        self._release_held()
        return engine.status().weight_version

    async def stage_weights(self, msg: inference_pb2.StageWeightsRequest | bytes) -> dict[str, Any]:
        """Stage one bucket (rank 0's locally, rank r's on TP worker r)."""
        if isinstance(msg, bytes | bytearray | memoryview):
            msg = decode_stage_request(bytes(msg))
        if msg.adapter:
            return await self._stage_adapter(msg)
        if msg.commit_when_complete and self._receiving_ranks != 1:
            raise errors.InvalidArgument(
                f"commit_when_complete: a replica of {self._receiving_ranks} ranks commits on "
                "CommitWeights, once every rank is staged"
            )
        if self.engine is None:
            if not msg.model_config_json:
                raise errors.FailedPrecondition(
                    "model_config_json: this replica has no model yet; the first bucket must carry config.json"
                )
            try:
                config = ModelConfig.from_hf_dict(json.loads(msg.model_config_json))
            except ValueError as exc:
                raise errors.InvalidArgument(f"model_config_json: {exc}") from None
            await self._ensure_engine(config)
        if not 0 <= msg.rank < self._receiving_ranks:
            raise errors.InvalidArgument(f"rank: {msg.rank} outside [0, {self._receiving_ranks})")
        engine = self.engine
        # One bucket per rank at a time, each answered before the next is staged: the sender keeps
        # several buckets in flight and takes `complete` from the answer that reaches it last, so
        # answers must leave in staging order (staging is serialized by the stager's lock anyway).
        assert self.weights is not None
        async with self._stage_locks.setdefault(msg.rank, asyncio.Lock()):
            out = await self.weights.stage(msg)
        if msg.commit_when_complete and out["complete"]:
            await self.commit_weights(msg.version)
        out["serving_version"] = engine.status().weight_version
        return out

    def _adapters(self) -> Adapters:
        if self.adapters is None:
            raise errors.FailedPrecondition(
                f"adapter: replica {self.name} serves no LoRA adapters (its deployment's max_loras is 0, "
                "or its base is not loaded yet)"
            )
        return self.adapters

    async def _stage_adapter(self, msg: inference_pb2.StageWeightsRequest) -> dict[str, Any]:
        """One bucket of a run's adapter version, staged beside the base and the other adapters."""
        adapters = self._adapters()
        config = None
        if msg.model_config_json:
            try:
                config = ModelConfig.from_hf_dict(json.loads(msg.model_config_json))
            except ValueError as exc:
                raise errors.InvalidArgument(f"model_config_json: {exc}") from None
        if msg.rank != 0:
            raise errors.InvalidArgument(f"rank: {msg.rank} outside [0, 1)")
        weights = adapters.get(msg.adapter, config)
        async with self._stage_locks.setdefault(msg.adapter, asyncio.Lock()):
            out = await weights.stage(msg)
        if msg.commit_when_complete and out["complete"]:
            await self.commit_weights(msg.version, msg.adapter)
        out["serving_version"] = weights.serving_version()
        return out

    async def drop_adapter(self, adapter: str) -> None:
        """A run ended: free its adapter slot (its requests still in flight end as aborted)."""
        if self.adapters is not None:
            self.adapters.drop(adapter)

    async def commit_weights(self, version: int, adapter: str = "") -> int:
        if adapter:
            weights = self._adapters().of(adapter)
            async with self._lock():
                if weights.serving_version() != version:
                    await weights.commit(version)
            self._release_held()
            log.info("replica %s now serves adapter %s at version %d", self.name, adapter, version)
            return weights.serving_version()
        engine = self.engine
        if engine is None:
            raise errors.FailedPrecondition(
                f"version: nothing staged, this replica has no model (asked {version})"
            )
        async with self._lock():
            if engine.status().weight_version == version:
                return version  # a retried commit
            assert self.weights is not None
            await self.weights.commit(version)
        self._release_held()
        log.info("replica %s now serves weight version %d", self.name, version)
        self._annotate(weight_version=version)
        return engine.status().weight_version

    async def rollback_weights(self, version: int, adapter: str = "") -> int:
        """Stop serving `version` (a canary weight-sync rejected): serve the version before it again,
        swapped in between two decode steps. Returns the version now served; a retried rollback
        (the replica no longer serves `version`) is answered with the current version."""
        if adapter:
            weights = self._adapters().of(adapter)
            async with self._lock():
                if weights.holds(version):
                    await weights.rollback(version)
            return weights.serving_version()
        engine = self.engine
        if engine is None:
            raise errors.FailedPrecondition(
                f"version: this replica has no model, nothing to roll back ({version})"
            )
        async with self._lock():
            assert self.weights is not None
            if not self.weights.holds(version):
                return engine.status().weight_version
            previous = await self.weights.rollback(version)
            self.rolled_back_version = max(self.rolled_back_version, version)
        log.warning("replica %s rolled back weight version %d, serves %d again", self.name, version, previous)
        return engine.status().weight_version

    def _lock(self) -> asyncio.Lock:
        if self._weights_lock is None:
            self._weights_lock = asyncio.Lock()
        return self._weights_lock

    async def abort_weights(self, version: int, adapter: str = "") -> None:
        if adapter:
            if self.adapters is not None and adapter in self.adapters.lifecycles:
                await self.adapters.of(adapter).abort(version)
            return
        if self.weights is not None:
            await self.weights.abort(version)

    # ------------------------------------------------------------------ generation
    def _release_held(self) -> None:
        """A new version serves: the requests held for it start. An event wakes them all in the same
        turn of the loop, so every one is queued before the engine's next step and they are prefilled
        as one batch (a condition would let them through one lock hand-off at a time, and the engine
        would step with the first alone)."""
        if self._committed is not None:
            self._committed.set()
            self._committed = None

    async def _hold_for_version(self, req: inference_pb2.GenerateRequest) -> None:
        """Wait up to req.version_wait_ms for req.min_weight_version to be committed here."""
        wanted, engine = req.min_weight_version, self.engine
        if req.version_wait_ms <= 0 or engine is None or self._served_version(req) >= wanted:
            return
        if self.spec.canary:
            raise errors.FailedPrecondition(
                f"version_wait_ms: replica {self.name} serves a canary deployment and does not hold "
                "requests for a version it has not checked"
            )
        try:
            async with asyncio.timeout(req.version_wait_ms / 1000):
                while self._served_version(req) < wanted:
                    if self._committed is None:
                        self._committed = asyncio.Event()
                    await self._committed.wait()
        except TimeoutError:
            raise errors.FailedPrecondition(
                f"min_weight_version: replica {self.name} still serves version "
                f"{self._served_version(req)} after holding the request {req.version_wait_ms} ms "
                f"for version {wanted}"
            ) from None

    def _adapter_of(self, req: inference_pb2.GenerateRequest) -> str:
        """The adapter a request is served with: its run's, on a replica serving LoRA runs."""
        if self.adapters is None:
            return ""
        if not req.run_id:
            raise errors.InvalidArgument(
                f"run_id: replica {self.name} serves LoRA runs' adapters; a request names its run"
            )
        return req.run_id

    def _served_version(self, req: inference_pb2.GenerateRequest) -> int:
        assert self.engine is not None
        adapter = self._adapter_of(req)
        if adapter:
            return self.adapters.versions().get(adapter, -1)  # type: ignore[union-attr]
        return self.engine.status().weight_version

    def _serving_engine(self) -> Engine:
        if self.engine is None or not self.engine.status().ready:
            raise errors.Unavailable(f"replica {self.name} has no weights yet")
        return self.engine

    def _annotate(self, **attributes: Any) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes(
                {telemetry.ATTR.DEPLOYMENT: self.spec.name, telemetry.ATTR.REPLICA: self.name}
                | {getattr(telemetry.ATTR, k.upper()): v for k, v in attributes.items()}
            )

    async def generate_proto(self, req: inference_pb2.GenerateRequest) -> inference_pb2.GenerateResponse:
        params = parse_params(req.kv_transfer_params)
        if params.get("do_remote_decode"):
            return await self._prefill_for_transfer(req)
        await self._hold_for_version(req)
        engine = self._serving_engine()
        adapter = self._adapter_of(req)
        request, how = await self._engine_request(req, params, adapter)
        [result] = await engine.generate([request])
        self._annotate(
            weight_version=min((c.weight_version for c in result.completions), default=-1),
            tokens=result.prompt_tokens + sum(len(c.token_ids) for c in result.completions),
        )
        return inference_pb2.GenerateResponse(
            completions=[
                inference_pb2.Completion(
                    token_ids=c.token_ids,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    weight_version=c.weight_version,
                    token_versions=c.token_versions,
                    kv_versions=c.kv_versions,
                )
                for c in result.completions
            ],
            deployment=self.spec.name,
            replica=self.name,
            prompt_tokens=result.prompt_tokens,
            adapter=adapter,
            **(self._worker().answer(request, params, how) if self.spec.disaggregation else {}),
        )

    async def _engine_request(
        self, req: inference_pb2.GenerateRequest, params: dict[str, Any], adapter: str = ""
    ) -> tuple[EngineRequest, str]:
        """The engine's request (a decode worker's: from the handed-over KV) and how the KV came."""
        request = engine_request(req, adapter)
        if not params.get("do_remote_prefill"):
            return request, ""
        return await self._worker().decode_request(self._serving_engine(), request, params)

    async def _prefill_for_transfer(
        self, req: inference_pb2.GenerateRequest
    ) -> inference_pb2.GenerateResponse:
        await self._hold_for_version(req)
        engine = self._serving_engine()
        request = engine_request(req)
        params = await self._worker().prefill(engine, request, parse_params(req.kv_transfer_params))
        return inference_pb2.GenerateResponse(
            deployment=self.spec.name,
            replica=self.name,
            prompt_tokens=len(request.prompt_token_ids),
            kv_transfer_params=params,
        )

    def _worker(self) -> WorkerKV:
        """This replica as a disaggregated deployment's worker (else FAILED_PRECONDITION)."""
        if self.spec.disaggregation is None:
            raise errors.FailedPrecondition(
                f"kv_transfer_params: replica {self.name} is not a worker of a disaggregated deployment"
            )
        if self._kv is None:
            self._kv = WorkerKV(self.name, self._address, self.spec.disaggregation, self._wait_for_commit)
        return self._kv

    async def _wait_for_commit(self, version: int) -> None:
        """KV made under a version this worker is about to commit: wait for it, bounded (after that
        the engine recomputes the prompt under the version it serves)."""
        engine = self._serving_engine()
        try:
            async with asyncio.timeout(COMMIT_WAIT_S):
                while engine.status().weight_version < version:
                    if self._committed is None:
                        self._committed = asyncio.Event()
                    await self._committed.wait()
        except TimeoutError:
            log.warning(
                "replica %s: version %d did not commit within %.0fs", self.name, version, COMMIT_WAIT_S
            )

    async def _fetch_kv(self, kv_id: str) -> AsyncIterator[inference_pb2.FetchKVResponse]:
        async for chunk in fetch_chunks(self.engine, kv_id):
            yield chunk

    async def stream_proto(
        self, req: inference_pb2.GenerateRequest
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]:
        params = parse_params(req.kv_transfer_params)
        if params.get("do_remote_decode"):
            raise errors.InvalidArgument("kv_transfer_params: a prefill for transfer is a unary Generate")
        await self._hold_for_version(req)
        engine = self._serving_engine()
        adapter = self._adapter_of(req)
        request, _ = await self._engine_request(req, params, adapter)
        async for chunk in engine.generate_stream(request):
            yield inference_pb2.GenerateStreamResponse(
                index=chunk.index,
                token_ids=chunk.token_ids,
                logprobs=chunk.logprobs,
                weight_version=chunk.weight_version,
                finish_reason=chunk.finish_reason,
                deployment=self.spec.name,
                replica=self.name,
                adapter=adapter,
            )

    # ------------------------------------------------------------------ the router's Ray surface
    async def generate(self, request_bytes: bytes, trace_headers: Mapping[str, str] | None = None) -> bytes:
        await self.start()
        req = inference_pb2.GenerateRequest.FromString(request_bytes)
        # A SERVER span for a call that came over Ray, in the caller's trace (its headers).
        with _tracer.start_as_current_span(
            "replica generate", context=telemetry.extract(trace_headers), kind=trace.SpanKind.SERVER
        ):
            return (await self.generate_proto(req)).SerializeToString()

    async def generate_stream(
        self, request_bytes: bytes, trace_headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[bytes]:
        """Async generator: call with `.options(num_returns="streaming")`; yields GenerateStreamResponse bytes."""
        await self.start()
        req = inference_pb2.GenerateRequest.FromString(request_bytes)
        # Not made current: an async generator resumes in its consumer's context at every chunk.
        span = _tracer.start_span(
            "replica generate_stream",
            context=telemetry.extract(trace_headers),
            kind=trace.SpanKind.SERVER,
            attributes={telemetry.ATTR.DEPLOYMENT: self.spec.name, telemetry.ATTR.REPLICA: self.name},
        )
        tokens = 0
        try:
            async for chunk in self.stream_proto(req):
                tokens += len(chunk.token_ids)
                yield chunk.SerializeToString()
        finally:
            span.set_attribute(telemetry.ATTR.TOKENS, tokens)
            span.end()

    async def address(self) -> str:
        return await self.start()

    async def ready(self) -> bool:
        await self.start()
        return self.engine is not None and self.engine.status().ready

    async def status(self, adapter: str = "") -> ReplicaStatus:
        """This replica's status; with `adapter` (a LoRA run's view of a replica it may share), the
        weight version is that run's adapter's, -1 until it holds one."""
        await self.start()
        s = self.spec
        out = ReplicaStatus(
            replica=self.name,
            deployment=s.name,
            address=self._address,
            # Every TP rank receives through this one server; StageWeightsRequest.rank picks the rank.
            rank_addresses=[self._address] * self._receiving_ranks,
            host_id=host_identity(),
            backend=s.backend,
            tensor_parallel=s.tensor_parallel,
            layout=self.layout.naming,
            dtype=self.layout.dtype,
            max_model_len=s.max_model_len,
            vocab_size=self.config.vocab_size if self.config else 0,
            paused=self._paused,
            rolled_back_version=self.rolled_back_version,
            holds_for_version=not s.canary,
        )
        if self.engine is not None:
            st = self.engine.status()
            out.ready, out.weight_version = st.ready, st.weight_version
            out.outstanding_requests = st.queued_requests + st.running_sequences
            out.outstanding_tokens, out.queued_requests = st.tokens_in_flight, st.queued_requests
            out.cache_usage, out.max_model_len = st.cache_usage, st.max_model_len
            out.engine = {k: v for k, v in st.extra.items() if isinstance(v, int | float | str)}
            if self._kv is not None:
                out.engine |= self._kv.figures()
        if self.weights is not None:
            versions = self.weights.versions()
            out.staged_version, out.rollback_version = versions.staged, versions.rollback
        if self.adapters is not None:
            out.adapter_versions = self.adapters.versions()
            if adapter:
                out.weight_version = out.adapter_versions.get(adapter, -1)
                lifecycle = self.adapters.lifecycles.get(adapter)
                versions = lifecycle.versions() if lifecycle is not None else None
                out.staged_version = versions.staged if versions is not None else -1
                out.rollback_version = versions.rollback if versions is not None else -1
        if self._doors is not None:
            out.metrics_address = self._doors.metrics_address
            self._doors.update(out)
        return out

    async def pause(self) -> None:
        self._paused = True
        if self.engine is not None:
            self.engine.pause()

    async def resume(self) -> None:
        self._paused = False
        if self.engine is not None:
            self.engine.resume()


class _EngineServicer(inference_pb2_grpc.InferenceEngineServiceServicer):
    """InferenceEngineService over a ReplicaCore (errors.ServiceError -> status via the kit interceptor)."""

    def __init__(self, core: ReplicaCore) -> None:
        self.core = core

    async def Generate(self, request, context):
        return await self.core.generate_proto(request)

    async def Status(self, request, context):
        return (await self.core.status()).to_proto()

    async def Pause(self, request, context):
        await self.core.pause()
        return inference_pb2.PauseResponse()

    async def Resume(self, request, context):
        await self.core.resume()
        return inference_pb2.ResumeResponse()

    async def StageWeights(self, request_iterator, context):
        last: dict[str, Any] | None = None
        async for msg in request_iterator:
            last = await self.core.stage_weights(msg)
        if last is None:
            raise errors.InvalidArgument("StageWeights: the stream carried no bucket")
        return inference_pb2.StageWeightsResponse(**last)

    async def CommitWeights(self, request, context):
        version = await self.core.commit_weights(int(request.version), request.adapter)
        return inference_pb2.CommitWeightsResponse(weight_version=version)

    async def AbortWeights(self, request, context):
        await self.core.abort_weights(int(request.version), request.adapter)
        return inference_pb2.AbortWeightsResponse()

    async def RollbackWeights(self, request, context):
        version = await self.core.rollback_weights(int(request.version), request.adapter)
        return inference_pb2.RollbackWeightsResponse(weight_version=version)

    async def ProbeSharedMemory(self, request, context):
        return read_probe(request)

    async def FetchKV(self, request, context):
        async for chunk in self.core._fetch_kv(request.kv_id):
            yield chunk
