"""The vLLM engine behind the same Engine interface (GPU deployments). vLLM is imported lazily.

Runs vLLM's V1 `AsyncLLM` in the replica process (vLLM spawns its own engine-core and TP worker
processes). Requests go in as token ids (`TokensPrompt`, tokenizer init skipped) and stream back
as DELTA outputs, so tokens are seen as they are sampled.

Log-prob convention (engine/base.py): log softmax(logits / T) BEFORE top-k/top-p truncation.
vLLM offers `raw_logprobs` (before temperature) and `processed_logprobs` (after temperature AND
truncation, renormalised). With top_k disabled and top_p = 1 the processed log-probs are exactly
our convention, and greedy requests report them at temperature 1 as ours do; so the engine runs
with logprobs_mode="processed_logprobs" and, by default, REJECTS truncated sampling with
INVALID_ARGUMENT rather than hand the trainer log-probs of a different distribution
(`allow_truncated_logprobs=True` accepts them, documented as the truncated distribution).

Weights go through vLLM's own weight-transfer API with looprl's backend
(engine/vllm_transfer.py, registered in every worker). The replica stages each TP rank's
resharded rectangles (vLLM's fused names and shard shapes) in its own stager; `swap(version,
rank_states)` then runs, in order:

1. `pause_generation(mode=...)`: "keep" (the default, async runs) freezes in-flight requests
   where they are; "abort" aborts them, and with `retry_aborted` each aborted completion
   continues after the swap as a new request over its prompt plus the tokens it already had.
   New requests wait at the engine's own gate until the swap ends.
2. `start_weight_update`, `update_weights` twice (phase "verify" on every rank, then "load":
   a version that fails a check anywhere is never written), `finish_weight_update(weight_version=v)`.
3. `reset_prefix_cache` while still paused, checked to return True (it returns False while
   requests hold KV blocks; with frozen requests it preempts them, so their KV is recomputed
   under the new weights, and raises where even that cannot free them).
4. `resume_generation`.

A failed transfer before the load phase ends the weight-update session and resumes with the old
version served; after the verify phase every worker's verdict is read back (`collective_rpc`), so
a rank whose copy does not check out stops the version before any rank loads it. A failure from
the load phase on (a rank's load raising after others loaded, the finish, the prefix-cache
reset) can leave ranks on different versions or KV from the old weights: the engine then takes
itself out of service (not ready, never resumed, the reason in its status) and raises.
Disaggregation: a worker of a disaggregated deployment runs with a kv_transfer_config
(vllm_args.kv_transfer_config: the deployment's connector, kv_both, recompute on a failed load)
and its own NIXL side channel (host and port in the environment its engine core inherits). A
request's `kv_transfer_params` go to vLLM in `SamplingParams.extra_args`, where vLLM's Request reads
them, and the connector's answer comes back on the final output (`RequestOutput.kv_transfer_params`,
`EngineResult.kv_transfer_params`); only a request's first submission carries them (after an abort
or a refusal the connector has freed or never loaded the KV, so the continuation recomputes).
Per-token versions: vLLM labels every step with the version set by `finish_weight_update` and
reports the spans on a request's final output (`CompletionOutput.weight_versions`); completions
take their token versions from those spans, streamed chunks the version served when they were
read. A deployment with no model path starts from its config with load_format="dummy" and is
not ready until the first version is loaded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NoReturn

import torch

from services.inference_router.engine.base import (
    FINISH_ABORT,
    Completion,
    Engine,
    EngineRequest,
    EngineResult,
    EngineStatus,
    StreamChunk,
    validate_request,
)
from services.inference_router.engine.vllm_args import (
    PAUSE_MODES,
    STATUS_RPC,
    admitted,
    engine_args,
    init_info_of,
    nixl_environment,
    token_versions_of,
)
from services.inference_router.engine.vllm_handoff import RankHandoff, manifest_of
from services.inference_router.engine.vllm_lora import VLLMAdapters
from services.kit.config.recipe import DeploymentSpec
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout
from services.weights.errors import ChecksumMismatch, InvalidWeights

log = logging.getLogger("looprl.inference_router.vllm")


def vllm_sampling_params(**kwargs: Any) -> Any:
    """vLLM SamplingParams streaming DELTA outputs (a seam: CPU tests cannot import vllm.sampling_params)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)


def vllm_api() -> Any:
    """The three vLLM classes `create` builds on (a seam: CPU tests run `create` itself with the
    recording double, so what a recipe sets is shown to reach vLLM and the engine)."""
    from vllm import AsyncEngineArgs
    from vllm.config import KVTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
    from vllm.v1.engine.async_llm import AsyncLLM

    return SimpleNamespace(
        AsyncEngineArgs=AsyncEngineArgs,
        AsyncLLM=AsyncLLM,
        WeightTransferInitRequest=WeightTransferInitRequest,
        KVTransferConfig=KVTransferConfig,
    )


def tokens_prompt(ids: list[int]) -> Any:
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)


class SwapError(RuntimeError):
    """A weight swap that could not complete; the message says which step."""


class VLLMEngine(Engine):
    def __init__(
        self,
        llm: Any,
        config: ModelConfig,
        max_model_len: int,
        max_waiting: int,
        allow_truncated_logprobs: bool,
        version: int,
        default_stop: tuple[int, ...],
        layout: Layout | None = None,
        pause_mode: str = "keep",
        retry_aborted: bool = True,
    ):
        if pause_mode not in PAUSE_MODES:
            raise InvalidArgument(f"pause_mode: must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.llm = llm
        self.config = config
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.allow_truncated = allow_truncated_logprobs
        self.version = version
        self.default_stop = default_stop
        self.layout = layout or Layout(1, "fused", "bfloat16")
        self.pause_mode = pause_mode
        self.retry_aborted = retry_aborted
        self._gate = asyncio.Event()  # set = requests may enter vLLM
        self._gate.set()
        self._user_paused = False
        self._swap_lock = asyncio.Lock()
        self._swaps = 0  # swaps started (a request aborted by one knows it from this)
        self._broken = ""
        self._active: dict[str, dict[str, Any]] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.swap_seconds: dict[int, float] = {}
        self._adapter_dir: tempfile.TemporaryDirectory | None = None
        self.lora: VLLMAdapters | None = None  # LoRA runs' adapters (enable_lora)

    # ---------------------------------------------------------------- LoRA
    @property
    def adapter_versions(self) -> dict[str, int]:
        return self.lora.versions if self.lora is not None else {}

    async def serve_adapter(
        self,
        name: str,
        version: int,
        adapter_config: ModelConfig,
        state: Mapping[str, torch.Tensor],
        backwards: bool = False,
    ) -> None:
        """Serve version `version` of run `name`'s adapter to its next requests (vllm_lora.py)."""
        if self.lora is None:
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="looprl-vllm-lora-")
            self.lora = VLLMAdapters(Path(self._adapter_dir.name))
        lora = self.lora
        await asyncio.to_thread(lora.install, name, version, adapter_config, state, backwards)

    def drop_adapter(self, name: str) -> None:
        if self.lora is not None:
            self.lora.drop(name)

    @classmethod
    async def create(
        cls,
        config: ModelConfig,
        spec: DeploymentSpec,
        stop_token_ids: tuple[int, ...] = (),
        allow_truncated_logprobs: bool = False,
        retry_aborted: bool = True,
        side_channel_host: str = "127.0.0.1",
    ) -> VLLMEngine:
        """An AsyncLLM serving one replica of `spec` (its model_path, or `config` with dummy weights
        until the first version arrives); a disaggregated deployment's worker listens for KV
        transfers on `side_channel_host`."""
        vllm = vllm_api()
        tmp = None
        model_path, load_format, version = spec.model_path, "auto", 0
        if not model_path:
            # Architecture only: dummy weights until the first version arrives.
            tmp = tempfile.TemporaryDirectory(prefix="looprl-vllm-")
            (Path(tmp.name) / "config.json").write_text(json.dumps(config.to_hf_dict()))
            model_path, load_format, version = tmp.name, "dummy", -1
        kwargs = engine_args(model_path, load_format, spec)
        if "kv_transfer_config" in kwargs:  # EngineArgs takes the config object, not a dict
            from services.kit.local.infra import free_port

            kwargs["kv_transfer_config"] = vllm.KVTransferConfig(**kwargs["kv_transfer_config"])
            os.environ.update(nixl_environment(side_channel_host, free_port()))
        args = vllm.AsyncEngineArgs(**kwargs)
        llm = vllm.AsyncLLM.from_engine_args(args)
        await llm.init_weight_transfer_engine(vllm.WeightTransferInitRequest(init_info=init_info_of(spec)))
        if version >= 0:
            await llm.update_weight_version(str(version))
        engine = cls(
            llm,
            config,
            args.max_model_len,
            spec.max_queued_requests,
            allow_truncated_logprobs,
            version,
            stop_token_ids,
            layout=Layout(spec.tensor_parallel, "fused", args.dtype),
            pause_mode=spec.pause_mode,
            retry_aborted=retry_aborted,
        )
        engine._tmp = tmp
        return engine

    # ---------------------------------------------------------------- generation
    def _sampling(
        self,
        request: EngineRequest,
        n: int,
        seed: int | None,
        max_tokens: int,
        kv: dict[str, Any] | None = None,
    ) -> Any:
        s = request.sampling
        if (s.top_k > 0 or s.top_p < 1.0) and not s.greedy and not self.allow_truncated:
            raise InvalidArgument(
                "sampling.top_p/top_k: the vllm backend can only report log-probs under the untruncated "
                "tempered distribution; use top_p=1 and top_k=0 for training rollouts"
            )
        return vllm_sampling_params(
            n=n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            max_tokens=max_tokens,
            stop_token_ids=list(s.stop_token_ids) + list(self.default_stop),
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            **({"extra_args": {"kv_transfer_params": kv}} if kv else {}),
        )

    async def _run(self, request: EngineRequest) -> AsyncIterator[tuple[StreamChunk, Any]]:
        """(chunk, vLLM's version spans of that completion, on its final chunk only)."""
        if self.version < 0:
            raise Unavailable("engine has no weights yet (waiting for the first weight version)")
        if self._broken:
            raise Unavailable(f"engine is out of service: {self._broken}")
        validate_request(request, vocab_size=self.config.vocab_size, max_model_len=self.max_model_len)
        if len(self._active) >= self.max_waiting:
            raise ResourceExhausted(f"engine queue full ({len(self._active)} requests)", retry_after_s=0.5)
        s = request.sampling
        lora, adapter_version = None, None
        if request.adapter:
            if self.lora is None:
                raise FailedPrecondition(f"adapter: {request.adapter!r} is not served here")
            lora, adapter_version = self.lora.request_of(request.adapter)
        rid = f"{request.request_id or uuid.uuid4().hex}-{uuid.uuid4().hex[:6]}"
        self._active[rid] = {"tokens": s.max_tokens * s.n}
        try:
            prompt, produced, attempts = list(request.prompt_token_ids), 0, 0
            while True:
                await self._gate.wait()
                if self._broken:  # woken by _break, not by a resume
                    raise Unavailable(f"engine is out of service: {self._broken}")
                swaps_at_start = self._swaps
                # Only the first submission hands vLLM the KV params (see the module docstring).
                kv = request.kv_transfer_params if (produced, attempts) == (0, 0) else None
                attempts += 1
                params = self._sampling(request, s.n, s.seed, s.max_tokens - produced, kv)
                retry, sampled = False, []
                stream = self._stream(
                    prompt, params, f"{rid}-{produced}-{self._swaps}", produced, lora, adapter_version
                )
                async for chunk, spans in admitted(stream):
                    if chunk is None:  # refused by an abort-mode pause it raced with: wait it out
                        retry = True
                        await asyncio.sleep(0.01)
                        break
                    sampled += chunk.token_ids
                    aborted_by_swap = chunk.finish_reason == FINISH_ABORT and self._swaps != swaps_at_start
                    if (
                        aborted_by_swap
                        and self.retry_aborted
                        and s.n == 1
                        and produced + len(sampled) < s.max_tokens
                    ):
                        # Continue after the swap from where the abort left it (n=1 only: a
                        # fork of n completions cannot be resumed as one request).
                        if chunk.token_ids or spans:
                            yield (
                                StreamChunk(0, chunk.token_ids, chunk.logprobs, chunk.weight_version, ""),
                                spans,
                            )
                        prompt += sampled
                        produced += len(sampled)
                        retry = True
                        continue
                    yield chunk, spans
                if not retry:
                    return
        finally:
            self._active.pop(rid, None)

    async def _stream(
        self,
        prompt: list[int],
        params: Any,
        rid: str,
        offset: int,
        lora: Any = None,
        adapter_version: int | None = None,
    ) -> AsyncIterator[tuple[StreamChunk, Any]]:
        """`lora`: the request's LoRARequest; its tokens are then at `adapter_version` (vLLM's
        version spans label the base weights', which an adapter request's version is not)."""
        extra = {"lora_request": lora} if lora is not None else {}
        async for out in self.llm.generate(tokens_prompt(prompt), params, rid, **extra):
            for comp in out.outputs:
                lps = [
                    float(step[tok].logprob) if step is not None and tok in step else float("nan")
                    for tok, step in zip(
                        comp.token_ids, comp.logprobs or [None] * len(comp.token_ids), strict=False
                    )
                ]
                # vLLM's WeightVersionSpan list (final output only), as (version, start, end) of
                # the whole completion's token indexes.
                spans = [
                    (int(sp.version), int(sp.start) + offset, int(sp.end) + offset)
                    for sp in getattr(comp, "weight_versions", None) or ()
                ]
                version = self.version
                if adapter_version is not None:
                    spans, version = [], adapter_version
                chunk = StreamChunk(
                    comp.index,
                    list(comp.token_ids),
                    lps,
                    version,
                    comp.finish_reason or "",
                    getattr(out, "kv_transfer_params", None),
                )
                yield chunk, spans

    async def generate_stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk]:
        async for chunk, _ in self._run(request):
            yield chunk

    async def generate(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        async def one(req: EngineRequest) -> EngineResult:
            comps = [Completion([], [], "", self.version, []) for _ in range(req.sampling.n)]
            spans: dict[int, list[Any]] = {}
            kv_params = None
            async for chunk, final_spans in self._run(req):
                kv_params = chunk.kv_transfer_params or kv_params
                c = comps[chunk.index]
                c.token_ids += chunk.token_ids
                c.logprobs += chunk.logprobs
                c.token_versions += [chunk.weight_version] * len(chunk.token_ids)
                if final_spans:
                    spans.setdefault(chunk.index, []).extend(final_spans)
                if chunk.finish_reason:
                    c.finish_reason = chunk.finish_reason
            for i, c in enumerate(comps):
                if i in spans:  # vLLM's own per-step labels are exact
                    labelled = token_versions_of(spans[i], len(c.token_ids), -1)
                    c.token_versions = [
                        v if v >= 0 else old for v, old in zip(labelled, c.token_versions, strict=True)
                    ]
                c.finish_reason = c.finish_reason or FINISH_ABORT
                c.weight_version = min(c.token_versions, default=self.version)
                # vLLM drops running requests' KV at every swap (_reset_prefix_cache) and recomputes
                # it under the new weights: no token is sampled from KV of another version.
                c.kv_versions = list(c.token_versions)
            return EngineResult(req.request_id, comps, len(req.prompt_token_ids), kv_params)

        return list(await asyncio.gather(*(one(r) for r in requests)))

    # ---------------------------------------------------------------- weights
    async def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """tp=1: rank 0's state dict (vLLM's fused names). A TP group swaps with `swap`."""
        await self.swap(version, [state_dict])

    async def rollback(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        await self.swap(version, [state_dict], allow_older=True)

    def _row_starts(self, rank: int) -> dict[str, int]:
        rows = self.layout.vocab_rows(self.config, rank).start
        return {"model.embed_tokens.weight": rows, "lm_head.weight": rows}

    async def swap(
        self, version: int, rank_states: Sequence[Mapping[str, torch.Tensor]], *, allow_older: bool = False
    ) -> None:
        """Serve `version` (one state dict per TP rank) on every worker, between two steps."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if len(rank_states) != self.layout.tp_size:
            raise FailedPrecondition(
                f"version: {len(rank_states)} rank state dicts for tp={self.layout.tp_size}"
            )
        if version <= self.version and not allow_older:
            return  # a retried commit
        async with self._swap_lock:
            start = asyncio.get_running_loop().time()
            handoffs: list[RankHandoff] = [
                manifest_of(version, state, self._row_starts(rank)) for rank, state in enumerate(rank_states)
            ]
            self._gate.clear()
            self._swaps += 1
            paused = loading = loaded = False
            try:
                await self.llm.pause_generation(mode=self.pause_mode, clear_cache=False)
                paused = True
                await self.llm.start_weight_update()
                try:
                    await self.llm.update_weights(
                        WeightTransferUpdateRequest(update_info=[h.for_phase("verify") for h in handoffs])
                    )
                    await self._check_verified(version)
                    loading = True
                    await self.llm.update_weights(
                        WeightTransferUpdateRequest(update_info=[h.for_phase("load") for h in handoffs])
                    )
                except BaseException as exc:
                    await self._end_session()
                    if loading:
                        self._break(f"version {version} failed while loading ({exc})", exc)
                    raise
                try:
                    await self.llm.finish_weight_update(weight_version=str(version))
                except BaseException as exc:
                    # Every rank loaded, but vLLM's version label did not move with the weights.
                    self._break(f"version {version} loaded but could not be finished ({exc})", exc)
                loaded = True
                await self._reset_prefix_cache(version)
            finally:
                for h in handoffs:
                    h.close()
                if paused and not self._broken:
                    await self.llm.resume_generation()
                if loaded:
                    # After the resume: a streamed chunk read before it holds old-version tokens
                    # only, and one read just after it is labelled old (stale is the safe side).
                    self.version = version
                if not self._user_paused and not self._broken:
                    self._gate.set()
            self.swap_seconds[version] = asyncio.get_running_loop().time() - start

    async def _check_verified(self, version: int) -> None:
        """Every worker checked its rank of `version`; else raise naming the first that did not."""
        reports = await self.llm.collective_rpc(STATUS_RPC)
        for rank, report in enumerate(reports):
            if int(report.get("verified", -1)) != version:
                why = report.get("error") or "no verdict"
                if "hash64" in why:
                    raise ChecksumMismatch(f"rank {rank}: {why}")
                raise InvalidWeights(f"rank {rank}: {why}")

    async def _end_session(self) -> None:
        """After a failed update: close the session on the workers that still hold it open
        (a worker whose update raised closed its own; vLLM refuses a second finish there)."""
        try:
            await self.llm.finish_weight_update()
        except Exception as exc:
            log.info("closing the failed weight-update session: %s", exc)

    def _break(self, why: str, cause: BaseException | None = None) -> NoReturn:
        """Take the engine out of service and raise: its weights or KV cache may mix two versions,
        which no request may see. vLLM stays paused (no resume), the engine reports not ready, so
        the router routes around it and has the replica recreated, and says why in its status
        (`extra["broken"]`). Requests waiting at the gate are woken to fail UNAVAILABLE (the router
        retries them elsewhere) rather than wait for a resume that never comes."""
        self._broken = f"{why}; this engine may hold mixed weights or stale KV and serves nothing"
        log.error("vLLM engine out of service: %s", self._broken)
        self._gate.set()
        raise SwapError(self._broken) from cause

    async def _reset_prefix_cache(self, version: int) -> None:
        """Drop every KV block computed under the old weights, while generation is paused. Frozen
        ("keep") requests hold blocks, so they are preempted and recompute under the new weights.
        With reset_running_requests=True vLLM 0.33 never returns False: a reset it cannot do raises
        in the scheduler (scheduler.py, reset_prefix_cache) and reaches us as an Exception from
        the utility call, so a raise counts as a failed reset too."""
        try:
            ok = await self.llm.reset_prefix_cache(reset_running_requests=self.pause_mode == "keep")
            if not ok and self.pause_mode != "keep":
                ok = await self.llm.reset_prefix_cache(reset_running_requests=True)
        except Exception as exc:
            self._break(f"the prefix cache could not be reset after loading version {version} ({exc})", exc)
        if not ok:
            self._break(f"the prefix cache could not be reset after loading version {version}")

    # ---------------------------------------------------------------- control
    def pause(self) -> None:
        self._user_paused = True
        self._gate.clear()

    def resume(self) -> None:
        self._user_paused = False
        if not self._swap_lock.locked() and not self._broken:
            self._gate.set()

    def status(self) -> EngineStatus:
        return EngineStatus(
            weight_version=self.version,
            ready=self.version >= 0 and not self._broken,
            paused=not self._gate.is_set() or bool(self._broken),
            queued_requests=len(self._active),
            running_sequences=len(self._active),
            tokens_in_flight=sum(a["tokens"] for a in self._active.values()),
            cache_usage=0.0,
            max_model_len=self.max_model_len,
            extra={"broken": self._broken} if self._broken else {},
        )

    async def close(self) -> None:
        self.llm.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()
        if self._adapter_dir is not None:
            self._adapter_dir.cleanup()
