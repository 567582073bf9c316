from spans.intervals import contains, merge, total_length


def test_merge_overlapping():
    assert merge([(1, 4), (2, 6), (8, 9)]) == [(1, 6), (8, 9)]


def test_merge_sorts():
    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]


def test_contains():
    assert contains([(1, 3)], 3) and not contains([(1, 3)], 4)
