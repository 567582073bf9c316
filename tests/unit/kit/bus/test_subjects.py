"""Subject, stream and bucket names: one place, validated run ids."""

import pytest

from services.kit.bus import subjects


def test_per_run_subjects() -> None:
    assert subjects.episodes("run-1") == "looprl.run-1.episodes"
    assert subjects.rollouts("r_2") == "looprl.r_2.rollouts"
    assert subjects.weights("R3") == "looprl.R3.weights"
    assert subjects.train("abc") == "looprl.abc.train"


@pytest.mark.parametrize("bad", ["", "a.b", "a*", "run>", "has space", "tab\t", "ünï", "x" * 129, None, 7])
def test_bad_run_ids_are_rejected_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match=r"run id .* is not valid"):
        subjects.episodes(bad)  # type: ignore[arg-type]


def test_error_names_the_bad_run_id() -> None:
    with pytest.raises(ValueError) as info:
        subjects.rollouts("my.run")
    assert "'my.run'" in str(info.value)


def test_streams_cover_every_runs_subjects() -> None:
    by_name = {s.name: s for s in subjects.STREAMS}
    assert set(by_name) == {"EPISODES", "ROLLOUTS", "WEIGHTS", "TRAIN", "RUN_EVENTS"}
    assert by_name["EPISODES"].retention is subjects.Retention.WORK_QUEUE
    assert by_name["ROLLOUTS"].retention is subjects.Retention.LIMITS
    assert by_name["EPISODES"].subjects == ("looprl.*.episodes",)
    assert by_name["ROLLOUTS"].subjects == ("looprl.*.rollouts",)
    assert by_name["RUN_EVENTS"].subjects == ("looprl.*.events",)
    for make in (subjects.episodes, subjects.rollouts, subjects.weights, subjects.train, subjects.events):
        subj = make("run-x")
        assert subjects.stream_for(subj) in by_name


def test_bucket_names() -> None:
    names = (
        subjects.RUNS,
        subjects.DEPLOYMENTS,
        subjects.WEIGHTS_KV,
        subjects.TRAINER_EPOCHS,
        subjects.PACKER_STEPS,
    )
    assert names == ("runs", "deployments", "weights", "trainer-epochs", "packer")
    assert {b.name for b in subjects.BUCKETS} == set(names)


def test_packer_step_keys_name_a_valid_run_and_match_its_pattern() -> None:
    assert subjects.packer_step_key("run-x", 7) == "run-x.step.7"
    assert subjects.packer_step_key("run-x", "*") == "run-x.step.*"
    with pytest.raises(ValueError):
        subjects.packer_step_key("run.x", 7)  # a dot would let one run's pattern match another's keys


def test_run_of_reads_the_run_back() -> None:
    assert subjects.run_of(subjects.train("abc-1")) == "abc-1"
    with pytest.raises(ValueError, match="not of the form"):
        subjects.run_of("other.abc.train")


def test_durable_names_are_validated() -> None:
    assert subjects.validate_durable("packer-run1") == "packer-run1"
    with pytest.raises(ValueError, match="consumer name"):
        subjects.validate_durable("pack.er")
