"""Episode tasks that fail while a dependency is down are handed back with a growing delay, long
enough in total to outlive a restart, instead of being exhausted within seconds."""

from services.environment_sandbox.episode_worker import WorkerConfig


def test_retry_delay_doubles_up_to_its_cap() -> None:
    cfg = WorkerConfig()
    delays = [cfg.retry_delay(attempt) for attempt in range(1, 10)]
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0]
    assert max(delays) == cfg.max_retry_delay_s == delays[-1]


def test_the_attempts_cover_more_than_an_hour_of_outage() -> None:
    cfg = WorkerConfig()
    waited = sum(cfg.retry_delay(attempt) for attempt in range(1, cfg.max_deliver))
    assert waited > 3600
    # ... and the first 30 s of an outage (a restart, reward down for 30 s) cost only a few attempts.
    spent, attempts = 0.0, 0
    while spent < 30:
        attempts += 1
        spent += cfg.retry_delay(attempts)
    assert attempts <= 7
