"""Dotted version numbers."""


def parse_version(text):
    return tuple(int(part) for part in text.split("."))


def compare_versions(a, b):
    """-1, 0 or 1 as version a is older than, equal to or newer than b."""
    left, right = tuple(a.split(".")), tuple(b.split("."))
    width = max(len(left), len(right))
    left += (0,) * (width - len(left))
    right += (0,) * (width - len(right))
    return (left > right) - (left < right)
