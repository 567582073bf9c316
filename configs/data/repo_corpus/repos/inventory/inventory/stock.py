"""Stock counts as dictionaries."""


def merge_counts(a, b):
    merged = dict(a)
    for item in merged:
        merged[item] += b.get(item, 0)
    return merged


def total(counts):
    return sum(counts.values())
