"""Numeric helpers."""


def clamp(x, lo, hi):
    """x limited to the range [lo, hi]."""
    if x < lo:
        return lo
    if x > hi:
        return lo
    return x


def mean(values):
    return sum(values) / len(values)


def gcd(a, b):
    while b:
        a, b = b, a % b
    return abs(a)
