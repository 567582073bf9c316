"""Output-length prediction: per source, sharpened by the group's and the prompt's earlier samples,
following drift, bounded in memory."""

from __future__ import annotations

import pytest

from services.decisions.length_prediction import (
    BASIS_GROUP,
    BASIS_NONE,
    BASIS_PROMPT,
    BASIS_SOURCE,
    LengthKey,
    LengthPredictor,
    prompt_digest,
)

SHORT = LengthKey.of("run", "arith", 0, 512)
LONG = LengthKey.of("run", "proofs", 0, 512)


def test_an_unseen_source_is_unknown_and_seen_sources_predict_their_own_lengths():
    p = LengthPredictor()
    assert p.predict(SHORT).tokens == 0 and p.predict(SHORT).basis == BASIS_NONE
    for _ in range(20):
        p.observe(SHORT, [30, 34])
        p.observe(LONG, [400, 440])
    short, long_ = p.predict(SHORT), p.predict(LONG)
    assert short.basis == long_.basis == BASIS_SOURCE
    assert short.tokens == 32 and long_.tokens == 420
    # Another run, turn or cap is another key: nothing learned there.
    assert p.predict(LengthKey.of("other-run", "arith", 0, 512)).tokens == 0
    assert p.predict(LengthKey.of("run", "arith", 1, 512)).tokens == 0


def test_predictions_never_exceed_the_cap_and_truncated_completions_count_as_the_cap():
    p = LengthPredictor()
    key = LengthKey.of("run", "s", 0, 64)
    p.observe(key, [1000, 64])  # a completion cannot be longer than max_tokens: read it as 64
    assert p.predict(key).tokens == 64
    assert p.source_estimate(key) == 64


def test_the_group_and_the_prompt_sharpen_the_source_estimate():
    p = LengthPredictor(prior_strength=2.0)
    for _ in range(50):
        p.observe(SHORT, [50])
    prompt = prompt_digest([1, 2, 3])
    # Two earlier samples of this group were short: the prediction moves half way (2 vs prior 2).
    p.observe(SHORT, [10, 10], group="g1", prompt=prompt)
    in_group = p.predict(SHORT, group="g1", prompt=prompt)
    assert in_group.basis == BASIS_GROUP and in_group.evidence == 2
    source = p.source_estimate(SHORT)
    assert in_group.tokens == round((2 * source + 20) / 4)
    # A later group asking the same prompt learns from the first group's samples.
    later = p.predict(SHORT, group="g2", prompt=prompt)
    assert later.basis == BASIS_PROMPT and later.evidence == 2 and later.tokens == in_group.tokens
    # Another prompt of the source gets the source estimate.
    assert p.predict(SHORT, group="g3", prompt=prompt_digest([9])).basis == BASIS_SOURCE


def test_a_group_and_its_prompt_do_not_count_the_same_samples_twice():
    p = LengthPredictor(prior_strength=1.0)
    prompt = prompt_digest([7, 7])
    p.observe(SHORT, [100], group="old", prompt=prompt)  # an earlier step asked this prompt
    p.observe(SHORT, [20, 20], group="g", prompt=prompt)
    both = p.predict(SHORT, group="g", prompt=prompt)
    assert both.evidence == 3  # 1 from the prompt's other group + 2 of the group's own, not 5


def test_the_source_estimate_follows_drift():
    p = LengthPredictor(min_alpha=0.05)
    for _ in range(200):
        p.observe(LONG, [400])
    for _ in range(60):
        p.observe(LONG, [100])
    # A plain mean over all 260 would still say ~331; the weighted one has moved most of the way.
    assert p.predict(LONG).tokens < 120


def test_memory_is_bounded():
    p = LengthPredictor(max_keys=4, max_groups=8, max_prompts=8)
    for i in range(100):
        key = LengthKey.of("run", f"s{i}", 0, 0)
        p.observe(key, [i + 1], group=f"g{i}", prompt=prompt_digest([i]))
    assert len(p._sources) == 4 and len(p._groups) == 8 and len(p._prompts) == 8
    assert p.predict(LengthKey.of("run", "s99", 0, 0)).tokens == 100
    assert p.predict(LengthKey.of("run", "s0", 0, 0)).tokens == 0  # evicted


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_alpha"):
        LengthPredictor(min_alpha=0.0)
