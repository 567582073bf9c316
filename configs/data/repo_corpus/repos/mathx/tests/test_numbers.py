from mathx.numbers import clamp, gcd, mean


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_below():
    assert clamp(-3, 0, 10) == 0


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_gcd():
    assert gcd(12, 18) == 6
