"""Predicted output lengths: a running estimate per task source and profile, sharpened by the
lengths earlier samples of the same group and of the same prompt produced.

The router's length-profile policy routes on `GenerateRequest.expected_output_tokens`; without it
every request of a run carries the run's `max_tokens` and lands on the deployment tuned for the
longest outputs. The agent loop asks a `LengthPredictor` before each model turn and tells it each
completion's length afterwards.

The prediction is a **median**: a profile boundary asks on which side most of a request's
completions will land, and one completion that runs away to max_tokens (or stops at once) must not
move its whole source across the boundary, as it would move a mean. What it rests on:

- the **source window**: the last `window` completion lengths of the (task source, profile) key,
  so the estimate follows the policy as training moves its lengths;
- the **same prompt** seen before (an earlier step or epoch asked it) and the **same group**
  (earlier samples of a GRPO group, earlier branches of a forked episode): their lengths, pooled
  with the source window weighted as `prior_strength` observations (a weighted median: one sample
  against the default 2 does not move it, three or more that agree outvote it).

With no evidence at all the prediction is 0 ("unknown": the router falls back to max_tokens).
Completions cut at max_tokens count as max_tokens. Keys, groups and prompts are bounded LRU tables
of bounded windows, so a long run holds constant memory.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

BASIS_NONE = "none"
BASIS_SOURCE = "source"
BASIS_PROMPT = "prompt"
BASIS_GROUP = "group"
# Model turns past this index share one key: later turns of long episodes look alike.
MAX_TURN_KEY = 3
# Lengths kept per group or prompt: their latest samples are the evidence.
EVIDENCE_WINDOW = 32


@dataclass(frozen=True)
class LengthKey:
    """What lengths are pooled by: the run, the task source, and the request's profile within the
    episode (its model turn, capped at MAX_TURN_KEY, and the cap it is sampled with)."""

    run: str
    source: str
    turn: int = 0
    max_tokens: int = 0

    @classmethod
    def of(cls, run: str, source: str, turn: int, max_tokens: int) -> LengthKey:
        return cls(run, source, min(max(turn, 0), MAX_TURN_KEY), max_tokens)


@dataclass(frozen=True)
class Prediction:
    """Expected output tokens per completion (0: nothing to go on) and what it rests on."""

    tokens: int
    basis: str
    source_median: float | None = None
    evidence: int = 0  # lengths of the same group or prompt that went into it


def weighted_median(pairs: Sequence[tuple[float, float]]) -> float:
    """The median of (value, weight) pairs; half way between two values that split the weight evenly."""
    ordered = sorted(pairs)
    half = sum(w for _, w in ordered) / 2.0
    seen = 0.0
    for i, (value, weight) in enumerate(ordered):
        seen += weight
        if seen > half + 1e-12:
            return value
        if abs(seen - half) <= 1e-12 and i + 1 < len(ordered):
            return (value + ordered[i + 1][0]) / 2.0
    return ordered[-1][0]


class _Lru(OrderedDict):
    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def take(self, key: Any, factory: Callable[[], Any]) -> Any:
        value = self.get(key)
        if value is None:
            value = self[key] = factory()
            while len(self) > self.limit:
                self.popitem(last=False)
        else:
            self.move_to_end(key)
        return value


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """A short digest of a prompt's token ids: the same prompt asked again has the same digest."""
    h = hashlib.blake2b(digest_size=12)
    h.update(len(token_ids).to_bytes(4, "little"))
    for t in token_ids:
        h.update(int(t).to_bytes(4, "little", signed=True))
    return h.digest()


@dataclass
class LengthPredictor:
    """Predicts and learns output lengths; one per process (the agent loop's runner holds one)."""

    prior_strength: float = 2.0
    window: int = 128
    max_keys: int = 1024
    max_groups: int = 16_384
    max_prompts: int = 65_536
    _sources: _Lru = field(init=False, repr=False)
    _groups: _Lru = field(init=False, repr=False)
    _prompts: _Lru = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.prior_strength < 0 or self.window < 1:
            raise ValueError("prior_strength must be >= 0 and window >= 1")
        self._sources = _Lru(self.max_keys)
        self._groups = _Lru(self.max_groups)
        self._prompts = _Lru(self.max_prompts)  # (key, prompt) -> deque of (group, length)

    def predict(self, key: LengthKey, group: str = "", prompt: bytes = b"") -> Prediction:
        """Expected tokens per completion of a request with this key (clamped to key.max_tokens when
        that is set), from the source window and the group's and prompt's earlier samples."""
        source = self._sources.get(key)
        source_median = weighted_median([(n, 1.0) for n in source]) if source else None
        basis = BASIS_SOURCE if source_median is not None else BASIS_NONE
        evidence: list[float] = []
        # The prompt's samples from other groups (earlier steps or epochs asked it), then the
        # group's own (same prompt or episode, same policy version): the sharper evidence.
        if prompt and (seen := self._prompts.get((key, prompt))):
            others = [n for g, n in seen if not group or g != group]
            if others:
                evidence += others
                basis = BASIS_PROMPT
        if group and (own := self._groups.get((key, group))):
            evidence += own
            basis = BASIS_GROUP
        if not evidence and source_median is None:
            return Prediction(0, BASIS_NONE)
        pairs = [(n, 1.0) for n in evidence]
        if source:
            weight = self.prior_strength / len(source)
            pairs += [(n, weight) for n in source]
        tokens = max(1, round(weighted_median(pairs)))
        if key.max_tokens:
            tokens = min(tokens, key.max_tokens)
        return Prediction(tokens, basis, source_median, len(evidence))

    def observe(self, key: LengthKey, lengths: Sequence[int], group: str = "", prompt: bytes = b"") -> None:
        """Learn the output lengths of a request's completions (each one an observation)."""
        if not lengths:
            return
        capped = [min(n, key.max_tokens) if key.max_tokens else n for n in lengths]
        self._sources.take(key, lambda: deque(maxlen=self.window)).extend(capped)
        if group:
            self._groups.take((key, group), lambda: deque(maxlen=EVIDENCE_WINDOW)).extend(capped)
        if prompt:
            seen = self._prompts.take((key, prompt), lambda: deque(maxlen=EVIDENCE_WINDOW))
            seen.extend((group, n) for n in capped)

    def source_estimate(self, key: LengthKey) -> float | None:
        """The median of the key's window (None before any completion)."""
        source = self._sources.get(key)
        return weighted_median([(n, 1.0) for n in source]) if source else None
