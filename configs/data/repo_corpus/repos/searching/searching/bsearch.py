"""Binary search over sorted lists."""


def find_first(items, target):
    """Index of the first occurrence of target in sorted items, or -1."""
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1


def insert_sorted(items, value):
    index = 0
    while index < len(items) and items[index] <= value:
        index += 1
    return items[:index] + [value] + items[index:]
