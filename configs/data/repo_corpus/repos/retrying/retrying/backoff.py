"""Retry delays."""


def backoff_delays(base, factor, attempts, cap):
    """Delays before each retry: base, base * factor, ... each at most cap."""
    return [base * factor**i for i in range(attempts)]


def total_wait(base, factor, attempts, cap):
    return sum(backoff_delays(base, factor, attempts, cap))
