from statskit.summary import mean, median, mode


def test_mean():
    assert mean([1, 2, 6]) == 3


def test_median_odd():
    assert median([5, 1, 3]) == 3


def test_mode():
    assert mode([1, 2, 2, 3]) == 2
