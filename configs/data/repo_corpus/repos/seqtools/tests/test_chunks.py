from seqtools.chunks import chunk, flatten, unique


def test_chunk_even():
    assert chunk([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


def test_flatten():
    assert flatten([[1], [2, 3]]) == [1, 2, 3]


def test_unique_keeps_order():
    assert unique([3, 1, 3, 2, 1]) == [3, 1, 2]
