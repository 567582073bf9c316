"""Predicted output lengths: a running estimate per task source and profile, sharpened by the
lengths earlier samples of the same group and of the same prompt produced.

The router's length-profile policy routes on `GenerateRequest.expected_output_tokens`; without it
every request of a run carries the run's `max_tokens` and lands on the deployment tuned for the
longest outputs. The agent loop asks a `LengthPredictor` before each model turn and tells it each
completion's length afterwards.

What a prediction rests on, from weakest to strongest evidence:

- the **source estimate**: the mean output length of the source's (task source, profile) key, a
  running mean over its first completions that becomes an exponentially weighted one (weight
  `min_alpha`), so it follows the policy as training moves its lengths;
- **the same prompt** seen before (an earlier step or epoch asked it) and **the same group** (earlier
  samples of a GRPO group, or earlier branches of a forked episode): their mean length, shrunk toward
  the source estimate with the weight of `prior_strength` observations (empirical Bayes: one sample
  moves the prediction a third of the way with the default 2, eight samples 80%).

With no evidence at all the prediction is 0 ("unknown": the router falls back to max_tokens).
Completions cut at max_tokens count as max_tokens: that is the work they cost. Keys, groups and
prompts are bounded LRU tables, so a long run holds constant memory.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

BASIS_NONE = "none"
BASIS_SOURCE = "source"
BASIS_PROMPT = "prompt"
BASIS_GROUP = "group"
# Model turns past this index share one key: later turns of long episodes look alike.
MAX_TURN_KEY = 3


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
    source_mean: float | None = None
    evidence: int = 0  # observations of the same group or prompt that went into it


@dataclass
class RunningMean:
    """The plain mean of the first 1/min_alpha values, an exponentially weighted one after."""

    count: int = 0
    mean: float = 0.0

    def add(self, value: float, min_alpha: float) -> None:
        self.count += 1
        self.mean += (value - self.mean) * max(1.0 / self.count, min_alpha)


@dataclass
class _Evidence:
    count: int = 0
    total: float = 0.0

    def add(self, values: Iterable[float]) -> None:
        for v in values:
            self.count += 1
            self.total += v

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass
class _GroupEvidence(_Evidence):
    # What of the group's evidence was also recorded under each prompt, so that a prediction taking
    # both the group's and the prompt's samples counts none of them twice.
    by_prompt: dict[bytes, _Evidence] = field(default_factory=dict)


class _Lru(OrderedDict):
    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def take(self, key, factory):
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
    min_alpha: float = 0.05
    max_keys: int = 4096
    max_groups: int = 16_384
    max_prompts: int = 65_536
    _sources: _Lru = field(init=False, repr=False)
    _groups: _Lru = field(init=False, repr=False)
    _prompts: _Lru = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.prior_strength < 0 or not 0 < self.min_alpha <= 1:
            raise ValueError("prior_strength must be >= 0 and min_alpha in (0, 1]")
        self._sources = _Lru(self.max_keys)
        self._groups = _Lru(self.max_groups)
        self._prompts = _Lru(self.max_prompts)

    def predict(self, key: LengthKey, group: str = "", prompt: bytes = b"") -> Prediction:
        """Expected tokens per completion of a request with this key (clamped to key.max_tokens when
        that is set), from the source estimate and the group's and prompt's earlier samples."""
        source = self._sources.get(key)
        source_mean = source.mean if source is not None and source.count else None
        basis = BASIS_SOURCE if source_mean is not None else BASIS_NONE
        evidence = _Evidence()
        # The prompt's samples from other groups (earlier steps or epochs asked it), then the
        # group's own (same prompt or episode, same policy version): the sharper evidence.
        seen_group = self._groups.get((key, group)) if group else None
        seen_prompt = self._prompts.get((key, prompt)) if prompt else None
        if seen_prompt is not None:
            own = seen_group.by_prompt.get(prompt) if seen_group is not None else None
            count = seen_prompt.count - (own.count if own else 0)
            if count > 0:
                evidence.count += count
                evidence.total += seen_prompt.total - (own.total if own else 0.0)
                basis = BASIS_PROMPT
        if seen_group is not None and seen_group.count:
            evidence.count += seen_group.count
            evidence.total += seen_group.total
            basis = BASIS_GROUP
        if evidence.count == 0:
            if source_mean is None:
                return Prediction(0, BASIS_NONE)
            value = source_mean
        elif source_mean is None:
            value = evidence.mean
        else:
            k = self.prior_strength
            value = (k * source_mean + evidence.total) / (k + evidence.count)
        tokens = max(1, round(value))
        if key.max_tokens:
            tokens = min(tokens, key.max_tokens)
        return Prediction(tokens, basis, source_mean, evidence.count)

    def observe(self, key: LengthKey, lengths: Sequence[int], group: str = "", prompt: bytes = b"") -> None:
        """Learn the output lengths of a request's completions (each one an observation)."""
        if not lengths:
            return
        capped = [min(n, key.max_tokens) if key.max_tokens else n for n in lengths]
        source = self._sources.take(key, RunningMean)
        for n in capped:
            source.add(float(n), self.min_alpha)
        if prompt:
            self._prompts.take((key, prompt), _Evidence).add(capped)
        if group:
            entry = self._groups.take((key, group), _GroupEvidence)
            entry.add(capped)
            if prompt:
                entry.by_prompt.setdefault(prompt, _Evidence()).add(capped)

    def source_estimate(self, key: LengthKey) -> float | None:
        source = self._sources.get(key)
        return source.mean if source is not None and source.count else None
