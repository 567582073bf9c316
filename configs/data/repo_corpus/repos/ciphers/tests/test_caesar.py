from ciphers.caesar import shift, unshift


def test_shift_lower():
    assert shift("xyz", 3) == "abc"


def test_round_trip_lower():
    assert unshift(shift("hello, world", 5), 5) == "hello, world"
