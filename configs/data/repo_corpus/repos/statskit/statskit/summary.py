"""Summary statistics."""

from collections import Counter


def mean(values):
    return sum(values) / len(values)


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return ordered[middle]


def mode(values):
    return Counter(values).most_common(1)[0][0]
