"""Evaluation figures and schedule: pass@k is the unbiased estimator, the figures hold per task
source, evaluation episodes are marked so the episode queue refuses them, and their seeds do not
depend on the step (what `looprl eval` relies on to reproduce a run's figure)."""

from __future__ import annotations

import json

import pytest

from gateway.evaluation import eval_tasks, eval_versions, pass_at_k, summarize
from services.kit.config.recipe import RunRecord, parse_recipe

RECIPE = """
[run]
steps = 25
seed = 3
[environment]
name = "single_turn"
[dataset]
path = "data.jsonl"
eval_size = 4
[eval]
every = 10
samples = 4
"""


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)


def test_a_run_evaluates_before_training_every_k_steps_and_at_its_end() -> None:
    recipe = parse_recipe(RECIPE)
    assert eval_versions(recipe) == [0, 10, 20, 25]
    assert eval_versions(parse_recipe(RECIPE.replace("every = 10", "every = 0"))) == []


def test_evaluation_tasks_are_marked_and_seeded_by_prompt_not_step() -> None:
    recipe = parse_recipe(RECIPE)
    record = RunRecord(run_id="r", recipe_toml=RECIPE)
    at10 = eval_tasks(record, recipe, 10, '{"path": "x"}', eval_rows=4)
    at20 = eval_tasks(record, recipe, 20, '{"path": "x"}', eval_rows=4)
    assert len(at10) == 8 and all(t.evaluation and t.min_weight_version == 10 for _, t in at10)
    greedy = [t for _, t in at10 if t.sampling.temperature == 0.0]
    sampled = [t for _, t in at10 if t.sampling.temperature > 0.0]
    assert len(greedy) == 4 and all(t.branches == 4 for t in sampled)
    assert json.loads(at10[0][1].task_json) == {"index": 0, "seed": 3, "split": "eval"}
    assert [t.sampling.seed for _, t in at10] == [t.sampling.seed for _, t in at20]
    assert len({t.sampling.seed for t in sampled}) == 4


def test_figures_overall_and_per_source() -> None:
    recipe = parse_recipe(RECIPE)
    rows = [
        {"prompt": 0, "source": "a", "greedy": True, "reward": 1.0, "passed": True, "tokens": 3},
        {"prompt": 1, "source": "b", "greedy": True, "reward": 0.0, "passed": False, "tokens": 5},
        *(
            {"prompt": 0, "source": "a", "greedy": False, "reward": r, "passed": r >= 1, "tokens": 4}
            for r in (1, 0, 0, 0)
        ),
        *(
            {"prompt": 1, "source": "b", "greedy": False, "reward": 0.0, "passed": False, "tokens": 4}
            for _ in range(4)
        ),
    ]
    figures = summarize(rows, recipe, step=10, seconds=1.0)
    assert figures["pass_at_1"] == 0.5 and figures["pass_at_k"] == 0.5 and figures["k"] == 4
    assert figures["sources"]["a"]["pass_at_1"] == 1.0 and figures["sources"]["b"]["pass_at_k"] == 0.0
    assert figures["mean_response_tokens"] == pytest.approx(40 / 10)
