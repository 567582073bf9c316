"""What a user reads when a run cannot progress: the vocabulary check CreateRun applies, and a
stalled run's record as GetRun and `looprl runs` show it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gateway.admission import check_vocabulary
from gateway.progress import progress_line
from gateway.servicer import run_to_proto
from gateway.stalls import STALLED_KEY, apply_error, stall_reason
from looprl.events.v1 import events_pb2
from looprl.gateway.v1 import gateway_pb2
from services.kit.config.recipe import RunRecord, parse_recipe
from services.kit.rpc.errors import FailedPrecondition

RECIPE = "[run]\nsteps = 5\n"


def _model(tmp_path: Path, vocab_size: int) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": vocab_size}))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("vocab_size", "refused"),
    [
        (101, None),  # the char tokenizer's own size
        (101 + 271, None),  # padded past the tokenizer, as Qwen2.5 pads 151,665 ids to 151,936 rows
        (64, "the tokenizer 'char' has 101 ids, the model"),  # ids without an embedding row
        (1024, "has vocab_size 1024, the tokenizer 'char' only 101 ids"),  # ids it cannot decode
    ],
)
def test_tokenizer_and_model_vocabularies_must_fit(
    tmp_path: Path, vocab_size: int, refused: str | None
) -> None:
    recipe = parse_recipe(f"[model]\npath = '{_model(tmp_path, vocab_size)}'\n")
    if refused is None:
        check_vocabulary(recipe, tmp_path)
        return
    with pytest.raises(FailedPrecondition) as err:
        check_vocabulary(recipe, tmp_path)
    assert str(err.value).startswith("model.tokenizer: vocabulary mismatch: ")
    assert refused in str(err.value)


def test_presets_fit_the_char_tokenizer() -> None:
    for preset in ("tiny-qwen2", "small-qwen2"):
        check_vocabulary(parse_recipe(f"[model]\npreset = '{preset}'\n"), Path("."))


def test_a_stalled_run_reads_stalled_with_its_reason_and_last_error() -> None:
    progressed = time.time()
    record = RunRecord(run_id="r1", recipe_toml=RECIPE, state="running", step=2)
    for occurrences in (1, 4):  # two batched reports of the same component add up
        event = events_pb2.RunError(
            run_id="r1",
            component="environment-sandbox",
            message="episode failed: INVALID_ARGUMENT: prompt + max_tokens exceeds max_model_len 8",
            occurrences=occurrences,
            unix_time=progressed + 1,
        )
        apply_error(record, event)
    record.extra[STALLED_KEY] = stall_reason(record, 30.0, progressed)
    run = run_to_proto(record)
    assert run.state == gateway_pb2.RUN_STATE_STALLED
    assert run.stalled_reason.startswith("no progress at step 2/5 since ")
    assert "(run.stall_seconds = 30); environment-sandbox reported (5 errors reported): episode failed" in (
        run.stalled_reason
    )
    assert (run.last_error.component, run.last_error.occurrences) == ("environment-sandbox", 5)
    line = progress_line(run)
    assert line.startswith("[  stalled] step   2/5")
    assert "stalled: no progress at step 2/5" in line and "max_model_len 8" in line
    # The stall mark only counts while the run is running: a stopped run reads stopped.
    record.state = "stopped"
    assert run_to_proto(record).state == gateway_pb2.RUN_STATE_STOPPED


def test_an_error_older_than_the_last_progress_is_not_named_as_the_cause() -> None:
    record = RunRecord(run_id="r1", recipe_toml=RECIPE, state="running")
    apply_error(
        record, events_pb2.RunError(component="trainer", message="old", occurrences=1, unix_time=10.0)
    )
    assert stall_reason(record, 5.0, progressed_at=20.0).endswith(
        "no component reported an error since the last progress"
    )
    run = run_to_proto(record)
    assert run.state == gateway_pb2.RUN_STATE_RUNNING
    assert "last error trainer: old" in progress_line(run)
    down = stall_reason(record, 5.0, progressed_at=20.0, not_serving=["reward (DOWN: UNAVAILABLE)"])
    assert "(run.stall_seconds = 5); not serving: reward (DOWN: UNAVAILABLE); no component reported" in down


def test_the_progress_line_names_an_error_only_until_the_run_trains_past_it() -> None:
    record = RunRecord(run_id="r1", recipe_toml=RECIPE, state="running")
    apply_error(
        record, events_pb2.RunError(component="reward", message="timeout", occurrences=1, unix_time=100.0)
    )
    step = {k: 0.0 for k in ("reward_mean", "reward_std", "loss", "mean_staleness")}
    step.update(step=0, train_tokens_per_second=0.0, num_rollouts=64, seconds=0.1)
    before = progress_line(run_to_proto(record, history=[{**step, "at": 99.0}]))
    assert "last error reward: timeout" in before
    after = progress_line(run_to_proto(record, history=[{**step, "at": 101.0}]))
    assert "last error" not in after
    # GetRun still carries it: the line drops news that is old, the record keeps it.
    assert run_to_proto(record, history=[{**step, "at": 101.0}]).last_error.message == "timeout"


def test_a_fatal_report_fails_the_run_with_the_components_message() -> None:
    record = RunRecord(run_id="r1", recipe_toml=RECIPE, state="running", step=3)
    record.extra[STALLED_KEY] = "no progress at step 3/5"
    apply_error(
        record,
        events_pb2.RunError(component="trainer", message="training failed at step 3: boom", unix_time=1.0),
    )
    assert record.state == "running"  # an ordinary report names the error, the run goes on
    apply_error(
        record,
        events_pb2.RunError(
            component="trainer", message="training failed at step 3: boom", unix_time=2.0, fatal=True
        ),
    )
    run = run_to_proto(record)
    assert run.state == gateway_pb2.RUN_STATE_FAILED
    assert run.error == "trainer: training failed at step 3: boom"
    # A late fatal report does not rewrite a run that already ended.
    record.state, record.error = "stopped", ""
    apply_error(record, events_pb2.RunError(component="trainer", message="late", fatal=True))
    assert (record.state, record.error) == ("stopped", "")
