from searching.bsearch import find_first, insert_sorted


def test_find_unique():
    assert find_first([1, 3, 5, 7], 5) == 2


def test_find_missing():
    assert find_first([1, 3, 5], 4) == -1


def test_insert_sorted():
    assert insert_sorted([1, 3, 5], 4) == [1, 3, 4, 5]
