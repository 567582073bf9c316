"""Output-length prediction: a median per source and profile, sharpened by the group's and the
prompt's earlier samples, robust to a runaway completion, following drift, bounded in memory."""

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
    weighted_median,
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
    assert LengthKey.of("run", "arith", 9, 512) == LengthKey.of("run", "arith", 3, 512)


def test_a_runaway_completion_does_not_carry_its_source_across_a_profile_boundary():
    p = LengthPredictor()
    # A terse source whose samples now and then run to max_tokens: 3 of 16 here. Its mean (~101)
    # would cross a 64-token boundary; most of its completions do not.
    for _ in range(2):
        p.observe(SHORT, [5] * 6 + [512, 4])
    p.observe(SHORT, [5, 5, 512, 6, 5, 5, 5, 5])
    assert p.predict(SHORT).tokens == 5


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
    # One earlier sample of this group does not outvote the source (weight 2)...
    p.observe(SHORT, [10], group="g1", prompt=prompt)
    one = p.predict(SHORT, group="g1", prompt=prompt)
    assert one.basis == BASIS_GROUP and one.evidence == 1 and one.tokens == 50
    # ...three outvote it.
    p.observe(SHORT, [10, 10], group="g1", prompt=prompt)
    assert p.predict(SHORT, group="g1", prompt=prompt).tokens == 10
    # A later group asking the same prompt learns from the first group's samples.
    later = p.predict(SHORT, group="g2", prompt=prompt)
    assert later.basis == BASIS_PROMPT and later.evidence == 3 and later.tokens == 10
    # Another prompt of the source gets the source estimate.
    assert p.predict(SHORT, group="g3", prompt=prompt_digest([9])).basis == BASIS_SOURCE


def test_a_group_and_its_prompt_do_not_count_the_same_samples_twice():
    p = LengthPredictor()
    prompt = prompt_digest([7, 7])
    p.observe(SHORT, [100], group="old", prompt=prompt)  # an earlier step asked this prompt
    p.observe(SHORT, [20, 20], group="g", prompt=prompt)
    both = p.predict(SHORT, group="g", prompt=prompt)
    assert both.evidence == 3  # 1 from the prompt's other group + 2 of the group's own, not 5


def test_the_source_estimate_follows_drift():
    p = LengthPredictor(window=128)
    for _ in range(200):
        p.observe(LONG, [400])
    for _ in range(70):
        p.observe(LONG, [100])
    # The window holds the latest 128: most of them are the new lengths.
    assert p.predict(LONG).tokens == 100


def test_memory_is_bounded():
    p = LengthPredictor(max_keys=4, max_groups=8, max_prompts=8, window=16)
    for i in range(100):
        key = LengthKey.of("run", f"s{i}", 0, 0)
        p.observe(key, [i + 1] * 40, group=f"g{i}", prompt=prompt_digest([i]))
    assert len(p._sources) == 4 and len(p._groups) == 8 and len(p._prompts) == 8
    assert all(len(w) == 16 for w in p._sources.values())
    assert p.predict(LengthKey.of("run", "s99", 0, 0)).tokens == 100
    assert p.predict(LengthKey.of("run", "s0", 0, 0)).tokens == 0  # evicted


def test_the_weighted_median_splits_ties_and_bad_settings_are_refused():
    assert weighted_median([(10, 1.0), (50, 1.0)]) == 30
    assert weighted_median([(10, 1.0), (50, 2.0)]) == 50
    assert weighted_median([(3, 1.0)]) == 3
    with pytest.raises(ValueError, match="window"):
        LengthPredictor(window=0)
