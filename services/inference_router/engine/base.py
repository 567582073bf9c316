"""The one interface every inference backend implements (embedded CPU engine, TP group, vLLM).

An engine takes generation requests (prompt token ids + sampling parameters) and returns, per
request, its completions: the sampled token ids, the log-probability of each sampled token, the
finish reason and the weight version the tokens were sampled under.

Log-probability convention (the trainer must compute its log-probs the same way, or the importance
ratio is wrong from step one): the log-prob of a sampled token is taken under
``softmax(logits / temperature)`` over the FULL vocabulary, i.e. BEFORE top-k / top-p truncation.
Greedy decoding (temperature 0) reports the log-prob under temperature 1.

Weight swaps are atomic with respect to decode steps: every token is sampled under exactly one
version, and ``Completion.weight_version`` is the OLDEST version that produced any of its tokens
(a completion that straddles a swap is as stale as its oldest token), while
``Completion.token_versions`` keeps the exact version per token.
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from services.kit.rpc.errors import InvalidArgument

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Defaults follow common/v1 SamplingParams."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_proto(cls, msg: Any) -> SamplingParams:
        """From looprl.common.v1.SamplingParams: 0 means 'unset' for top_p (=1), n (=1), seed (None).

        temperature is taken as given (0 is greedy), max_tokens as given (validated later)."""
        return cls(
            temperature=float(msg.temperature),
            top_p=float(msg.top_p) if msg.top_p else 1.0,
            top_k=int(msg.top_k),
            max_tokens=int(msg.max_tokens),
            stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
            n=int(msg.n) if msg.n else 1,
            seed=int(msg.seed) if msg.seed else None,
        )


@dataclass
class EngineRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: str = ""
    request_id: str = ""
    adapter: str = ""
    """The LoRA adapter to sample with (a LoRA run's id on a deployment that serves adapters); empty:
    the engine's own weights."""
    # vLLM: the request's kv_transfer_params (a disaggregated deployment's two-phase request),
    # handed to vLLM's KV connector as they are.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    token_versions: list[int] = field(default_factory=list)
    # The weight version of the oldest KV each token was sampled from (engine-specific; may be empty).
    kv_versions: list[int] = field(default_factory=list)


@dataclass
class EngineResult:
    """All completions of one request (len == sampling.n), in index order."""

    request_id: str
    completions: list[Completion]
    prompt_tokens: int
    # vLLM: what its KV connector answered (a prefill instance: where the KV waits).
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class StreamChunk:
    """Tokens of completion `index` sampled since the previous chunk; finish_reason on the last."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str = ""
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class EngineStatus:
    weight_version: int
    ready: bool
    paused: bool
    queued_requests: int
    running_sequences: int
    tokens_in_flight: int
    cache_usage: float
    max_model_len: int
    staged_version: int = -1
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(abc.ABC):
    """A generation backend. All methods are coroutines safe to call concurrently from one loop."""

    @abc.abstractmethod
    async def generate(self, requests: Sequence[EngineRequest]) -> list[EngineResult]:
        """Generate every request (they join the running batch); results align with `requests`."""

    @abc.abstractmethod
    def generate_stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk]:
        """Stream chunks of tokens as they are sampled (all n completions interleaved by index)."""

    @abc.abstractmethod
    async def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Swap in a new weight version between two decode steps; in-flight requests continue."""

    async def rollback(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Serve the older `version` again (a rejected canary): like load_weights, but going back is
        allowed. Backends whose load_weights accepts any version need nothing more."""
        await self.load_weights(version, state_dict)

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop scheduling steps (requests keep queueing) until resume()."""

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def status(self) -> EngineStatus: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Abort outstanding requests and release resources."""


def validate_request(request: EngineRequest, *, vocab_size: int, max_model_len: int) -> None:
    """Raise InvalidArgument naming the field when a request cannot be served by this model."""
    prompt = request.prompt_token_ids
    s = request.sampling
    if len(prompt) == 0:
        raise InvalidArgument("prompt_token_ids: must not be empty")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidArgument(f"sampling.temperature: must be >= 0, got {s.temperature}")
    if not (0.0 < s.top_p <= 1.0):
        raise InvalidArgument(f"sampling.top_p: must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise InvalidArgument(f"sampling.top_k: must be >= 0 (0 disables), got {s.top_k}")
    if s.max_tokens <= 0:
        raise InvalidArgument(f"sampling.max_tokens: must be > 0, got {s.max_tokens}")
    if s.n <= 0:
        raise InvalidArgument(f"sampling.n: must be >= 1, got {s.n}")
    if len(prompt) + s.max_tokens > max_model_len:
        raise InvalidArgument(
            f"sampling.max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({s.max_tokens}) exceeds "
            f"the model length {max_model_len}"
        )
    bad_stop = next((t for t in s.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad_stop is not None:
        raise InvalidArgument(f"sampling.stop_token_ids: token id {bad_stop} is outside the vocabulary")
