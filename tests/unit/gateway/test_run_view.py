"""The public Run a gateway builds from a run's record (WatchRun polls, GetRun, ListRuns)."""

from __future__ import annotations

import gateway.servicer as servicer
from services.kit.config.recipe import RunRecord


def test_a_runs_recipe_is_parsed_once_however_often_its_run_is_built(monkeypatch) -> None:
    """Every watcher's poll builds the Run twice a second: the recipe it reads steps and samples_every
    from never changes, so it is not parsed again each time."""
    parsed = []
    parse = servicer.parse_recipe
    monkeypatch.setattr(servicer, "parse_recipe", lambda *a, **k: parsed.append(a[0]) or parse(*a, **k))
    servicer.recipe_facts.cache_clear()
    text = '[run]\nname = "watched"\nsteps = 7\n[logging]\nsamples_every = 3\n'
    record = RunRecord(run_id="w", recipe_toml=text, state="running")
    assert [servicer.run_to_proto(record).total_steps for _ in range(5)] == [7] * 5
    assert servicer.recipe_facts(text) == (7, 3) and parsed == [text]
    assert servicer.recipe_facts("[run]\nsteps = 'many'\n") == (0, 0)  # not a recipe it can read
