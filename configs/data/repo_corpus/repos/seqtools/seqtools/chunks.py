"""Sequence helpers."""


def chunk(items, size):
    """Consecutive pieces of `size` items; the last one may be shorter."""
    return [items[i : i + size] for i in range(0, len(items) - size + 1, size)]


def flatten(nested):
    return [x for inner in nested for x in inner]


def unique(items):
    seen = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out
