"""Lists of rows as matrices."""


def transpose(rows):
    return [[rows[r][c] for r in range(len(rows))] for c in range(len(rows))]


def identity(n):
    return [[1 if r == c else 0 for c in range(n)] for r in range(n)]


def matmul(a, b):
    return [[sum(x * y for x, y in zip(row, col)) for col in transpose(b)] for row in a]
