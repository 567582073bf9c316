from retrying.backoff import backoff_delays


def test_grows():
    assert backoff_delays(1, 2, 4, 100) == [1, 2, 4, 8]
