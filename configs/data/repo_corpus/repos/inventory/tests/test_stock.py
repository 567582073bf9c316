from inventory.stock import merge_counts, total


def test_merge_shared_keys():
    assert merge_counts({"a": 1}, {"a": 2}) == {"a": 3}


def test_total():
    assert total({"a": 1, "b": 2}) == 3
