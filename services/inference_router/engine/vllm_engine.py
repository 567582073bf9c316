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

Weights: `load_weights(version, hf_state_dict)` runs `collective_rpc("looprl_load_weights")` on
every vLLM worker through `WeightUpdateExtension` (vLLM's worker_extension_cls hook), which calls
the model's own `load_weights` (vLLM shards/fuses HF-named tensors into its TP layout itself),
then resets the prefix cache so no KV computed under the old weights is reused. The RPC runs in
the engine core between two steps, so a swap is atomic with respect to forward passes. Tokens
already delivered before the swap returns are attributed to the old version, later ones to the
new; the completion's weight_version is the oldest (tokens still in flight at the swap may be
attributed to the new version: conservative for staleness, which uses the oldest).
A deployment with no model path starts from its config with load_format="dummy" and is not
ready until the first version is loaded. Weight-sync should target such deployments with the
"hf" naming at tp=1 granularity (each vLLM worker takes full HF tensors and shards them).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

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
from services.kit.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.modeling.config import ModelConfig


class WeightUpdateExtension:
    """Mixed into every vLLM worker (worker_extension_cls): weight updates from the replica."""

    def looprl_load_weights(self, items: list[tuple[str, torch.Tensor]]) -> int:
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        model.load_weights(weights=((name, t.to(device, non_blocking=True)) for name, t in items))
        torch.cuda.synchronize()
        return len(items)


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
    ):
        self.llm = llm
        self.config = config
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.allow_truncated = allow_truncated_logprobs
        self.version = version
        self.default_stop = default_stop
        self._paused = asyncio.Event()
        self._paused.set()  # set = running
        self._active: dict[str, dict[str, Any]] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None

    @classmethod
    async def create(cls, config: ModelConfig, model_path: str, settings: Any) -> VLLMEngine:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        tmp = None
        load_format, version = "auto", 0
        if not model_path:
            # Architecture only: dummy weights until the first version arrives.
            tmp = tempfile.TemporaryDirectory(prefix="looprl-vllm-")
            (Path(tmp.name) / "config.json").write_text(json.dumps(config.to_hf_dict()))
            model_path, load_format, version = tmp.name, "dummy", -1
        args = AsyncEngineArgs(
            model=model_path,
            skip_tokenizer_init=True,
            tensor_parallel_size=int(getattr(settings, "tensor_parallel", 1)),
            dtype=str(getattr(settings, "dtype", "bfloat16")),
            max_model_len=int(getattr(settings, "max_model_len", 2048)),
            max_num_seqs=int(getattr(settings, "max_batch_size", 256)),
            gpu_memory_utilization=float(getattr(settings, "gpu_memory_utilization", 0.85)),
            load_format=load_format,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightUpdateExtension",
            enable_prefix_caching=True,
        )
        llm = AsyncLLM.from_engine_args(args)
        engine = cls(
            llm,
            config,
            args.max_model_len,
            int(getattr(settings, "max_queued_requests", 256)),
            bool(getattr(settings, "allow_truncated_logprobs", False)),
            version,
            tuple(getattr(settings, "stop_token_ids", ())),
        )
        engine._tmp = tmp
        return engine

    # ---------------------------------------------------------------- generation
    def _sampling(self, request: EngineRequest, n: int, seed: int | None) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        s = request.sampling
        if (s.top_k > 0 or s.top_p < 1.0) and not s.greedy and not self.allow_truncated:
            raise InvalidArgument(
                "sampling.top_p/top_k: the vllm backend can only report log-probs under the untruncated "
                "tempered distribution; use top_p=1 and top_k=0 for training rollouts"
            )
        return VSamplingParams(
            n=n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            max_tokens=s.max_tokens,
            stop_token_ids=list(s.stop_token_ids) + list(self.default_stop),
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    async def _run(self, request: EngineRequest) -> AsyncIterator[StreamChunk]:
        from vllm.inputs import TokensPrompt

        if self.version < 0:
            raise Unavailable("engine has no weights yet (waiting for the first weight version)")
        validate_request(request, vocab_size=self.config.vocab_size, max_model_len=self.max_model_len)
        if len(self._active) >= self.max_waiting:
            raise ResourceExhausted(f"engine queue full ({len(self._active)} requests)", retry_after_s=0.5)
        await self._paused.wait()
        rid = request.request_id or uuid.uuid4().hex
        rid = f"{rid}-{uuid.uuid4().hex[:6]}"
        # Seeded n>1: one vLLM request with the seed would give n correlated samples only through
        # vLLM's own per-request generator; that is what vLLM documents, so pass it through.
        params = self._sampling(request, request.sampling.n, request.sampling.seed)
        self._active[rid] = {"tokens": request.sampling.max_tokens * request.sampling.n}
        try:
            async for out in self.llm.generate(
                TokensPrompt(prompt_token_ids=request.prompt_token_ids), params, rid
            ):
                for comp in out.outputs:
                    lps = [
                        float(step[tok].logprob) if step is not None and tok in step else float("nan")
                        for tok, step in zip(
                            comp.token_ids, comp.logprobs or [None] * len(comp.token_ids), strict=False
                        )
                    ]
                    yield StreamChunk(
                        comp.index, list(comp.token_ids), lps, self.version, comp.finish_reason or ""
                    )
        finally:
            self._active.pop(rid, None)

    async def generate_stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk]:
        async for chunk in self._run(request):
            yield chunk

    async def generate(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        async def one(req: EngineRequest) -> EngineResult:
            comps = [Completion([], [], "", self.version, []) for _ in range(req.sampling.n)]
            async for chunk in self._run(req):
                c = comps[chunk.index]
                c.token_ids += chunk.token_ids
                c.logprobs += chunk.logprobs
                c.token_versions += [chunk.weight_version] * len(chunk.token_ids)
                if chunk.finish_reason:
                    c.finish_reason = chunk.finish_reason
            for c in comps:
                c.finish_reason = c.finish_reason or FINISH_ABORT
                c.weight_version = min(c.token_versions, default=self.version)
            return EngineResult(req.request_id, comps, len(req.prompt_token_ids))

        return list(await asyncio.gather(*(one(r) for r in requests)))

    # ---------------------------------------------------------------- weights and control
    async def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        items = [(name, t.detach().contiguous()) for name, t in state_dict.items()]
        await self.llm.collective_rpc("looprl_load_weights", args=(items,))
        await self.llm.reset_prefix_cache()
        self.version = version

    def pause(self) -> None:
        self._paused.clear()

    def resume(self) -> None:
        self._paused.set()

    def status(self) -> EngineStatus:
        return EngineStatus(
            weight_version=self.version,
            ready=self.version >= 0,
            paused=not self._paused.is_set(),
            queued_requests=len(self._active),
            running_sequences=len(self._active),
            tokens_in_flight=sum(a["tokens"] for a in self._active.values()),
            cache_usage=0.0,
            max_model_len=self.max_model_len,
        )

    async def close(self) -> None:
        self.llm.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()
