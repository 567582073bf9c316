"""The small repositories tools/make_repo_corpus.py builds: correct code, visible tests, seeded bugs.

Each spec is one Python package with one module (`source`, correct) and its visible tests
(`visible`: they pass with and without any of the bugs: the PASS_TO_PASS tests). Each bug is a
replacement in the source (`old` -> `new`, applied to make the repository's base revision), the
problem statement a user would file, and the hidden tests that catch it (FAIL_TO_PASS), added by
the task's test_patch to the visible test file or, with `new_file`, in a file of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Bug:
    old: str
    new: str
    statement: str
    hidden: str
    new_file: bool = False


@dataclass(frozen=True)
class Spec:
    package: str
    module: str
    source: str
    visible: str
    bugs: tuple[Bug, ...] = field(default_factory=tuple)


SPECS: tuple[Spec, ...] = (
    Spec(
        "textkit",
        "text",
        '''"""Small text helpers."""

import re


def slugify(text):
    """Lower-case words joined by single hyphens, nothing else."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower())
    return slug.strip("-")


def count_words(text):
    return len(text.split())


def title_case(text):
    return " ".join(word[:1].upper() + word[1:].lower() for word in text.split())
''',
        """from textkit.text import count_words, slugify, title_case


def test_slugify_joins_words():
    assert slugify("Hello World") == "hello-world"


def test_count_words():
    assert count_words("a b  c") == 3


def test_title_case():
    assert title_case("hello wORLD") == "Hello World"
""",
        (
            Bug(
                '    return slug.strip("-")\n',
                '    return slug.lstrip("-")\n',
                "slugify leaves a trailing hyphen: `slugify('Hello, World!')` gives 'hello-world-' but it "
                "should give 'hello-world'.",
                """

def test_slugify_strips_trailing_punctuation():
    assert slugify("Hello, World!") == "hello-world"
""",
            ),
        ),
    ),
    Spec(
        "mathx",
        "numbers",
        '''"""Numeric helpers."""


def clamp(x, lo, hi):
    """x limited to the range [lo, hi]."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def mean(values):
    return sum(values) / len(values)


def gcd(a, b):
    while b:
        a, b = b, a % b
    return abs(a)
''',
        """from mathx.numbers import clamp, gcd, mean


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_below():
    assert clamp(-3, 0, 10) == 0


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_gcd():
    assert gcd(12, 18) == 6
""",
        (
            Bug(
                "    if x > hi:\n        return hi\n",
                "    if x > hi:\n        return lo\n",
                "clamp is wrong above the range: clamp(15, 0, 10) returns 0 instead of 10.",
                """

def test_clamp_above():
    assert clamp(15, 0, 10) == 10
""",
            ),
        ),
    ),
    Spec(
        "spans",
        "intervals",
        '''"""Closed integer intervals as (start, end) pairs."""


def merge(intervals):
    """Overlapping or touching intervals merged, sorted by start."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def total_length(intervals):
    return sum(end - start for start, end in merge(intervals))


def contains(intervals, point):
    return any(start <= point <= end for start, end in intervals)
''',
        """from spans.intervals import contains, merge, total_length


def test_merge_overlapping():
    assert merge([(1, 4), (2, 6), (8, 9)]) == [(1, 6), (8, 9)]


def test_merge_sorts():
    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]


def test_contains():
    assert contains([(1, 3)], 3) and not contains([(1, 3)], 4)
""",
        (
            Bug(
                "        if merged and start <= merged[-1][1]:\n",
                "        if merged and start < merged[-1][1]:\n",
                "merge does not join intervals that touch: merge([(1, 3), (3, 5)]) should be [(1, 5)] but "
                "gives [(1, 3), (3, 5)].",
                """

def test_merge_touching():
    assert merge([(1, 3), (3, 5)]) == [(1, 5)]


def test_merge_touching_chain():
    assert merge([(3, 4), (1, 2), (2, 3)]) == [(1, 4)]
""",
            ),
        ),
    ),
    Spec(
        "numerals",
        "roman",
        '''"""Roman numerals."""

TABLE = [
    (1000, "M"),
    (900, "CM"),
    (500, "D"),
    (400, "CD"),
    (100, "C"),
    (90, "XC"),
    (50, "L"),
    (40, "XL"),
    (10, "X"),
    (9, "IX"),
    (5, "V"),
    (4, "IV"),
    (1, "I"),
]


def to_roman(number):
    out = []
    for value, letters in TABLE:
        while number >= value:
            out.append(letters)
            number -= value
    return "".join(out)


def from_roman(text):
    values = {"M": 1000, "D": 500, "C": 100, "L": 50, "X": 10, "V": 5, "I": 1}
    total = 0
    for i, letter in enumerate(text):
        value = values[letter]
        if i + 1 < len(text) and values[text[i + 1]] > value:
            total -= value
        else:
            total += value
    return total
''',
        """from numerals.roman import from_roman, to_roman


def test_to_roman_simple():
    assert to_roman(1987) == "MCMLXXXVII"


def test_from_roman():
    assert from_roman("MCMXCIV") == 1994
""",
        (
            Bug(
                '    (4, "IV"),\n',
                "",
                "to_roman(4) returns 'IIII'; it should be 'IV' (and 14 should be 'XIV').",
                """from numerals.roman import to_roman


def test_four():
    assert to_roman(4) == "IV"
    assert to_roman(14) == "XIV"
""",
                new_file=True,
            ),
        ),
    ),
    Spec(
        "seqtools",
        "chunks",
        '''"""Sequence helpers."""


def chunk(items, size):
    """Consecutive pieces of `size` items; the last one may be shorter."""
    return [items[i : i + size] for i in range(0, len(items), size)]


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
''',
        """from seqtools.chunks import chunk, flatten, unique


def test_chunk_even():
    assert chunk([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


def test_flatten():
    assert flatten([[1], [2, 3]]) == [1, 2, 3]


def test_unique_keeps_order():
    assert unique([3, 1, 3, 2, 1]) == [3, 1, 2]
""",
        (
            Bug(
                "    return [items[i : i + size] for i in range(0, len(items), size)]\n",
                "    return [items[i : i + size] for i in range(0, len(items) - size + 1, size)]\n",
                "chunk drops the last, shorter piece: chunk([1, 2, 3, 4, 5], 2) gives [[1, 2], [3, 4]] "
                "instead of [[1, 2], [3, 4], [5]].",
                """

def test_chunk_keeps_the_remainder():
    assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
""",
            ),
        ),
    ),
    Spec(
        "calendarx",
        "leap",
        '''"""Calendar helpers."""

DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def is_leap_year(year):
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_month(year, month):
    if month == 2 and is_leap_year(year):
        return 29
    return DAYS[month - 1]
''',
        """from calendarx.leap import days_in_month, is_leap_year


def test_ordinary_leap_years():
    assert is_leap_year(2024) and not is_leap_year(2023)


def test_days_in_month():
    assert days_in_month(2024, 2) == 29 and days_in_month(2023, 4) == 30
""",
        (
            Bug(
                "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
                "    return year % 4 == 0\n",
                "is_leap_year(1900) is True, but 1900 was not a leap year (centuries are leap years only "
                "when divisible by 400).",
                """

def test_century_years():
    assert not is_leap_year(1900)
    assert is_leap_year(2000)
    assert days_in_month(1900, 2) == 28
""",
            ),
        ),
    ),
    Spec(
        "ledger",
        "money",
        '''"""Money amounts in cents."""


def format_cents(cents):
    """'$1,234.05'; negative amounts as '-$1.00'."""
    sign = "-" if cents < 0 else ""
    dollars, rest = divmod(abs(cents), 100)
    return f"{sign}${dollars:,}.{rest:02d}"


def parse_money(text):
    text = text.replace("$", "").replace(",", "")
    negative = text.startswith("-")
    dollars, _, rest = text.lstrip("-").partition(".")
    cents = int(dollars) * 100 + int((rest + "00")[:2])
    return -cents if negative else cents
''',
        """from ledger.money import format_cents, parse_money


def test_format_thousands():
    assert format_cents(123405) == "$1,234.05"


def test_parse():
    assert parse_money("$1,234.5") == 123450
""",
        (
            Bug(
                """    sign = "-" if cents < 0 else ""
    dollars, rest = divmod(abs(cents), 100)
    return f"{sign}${dollars:,}.{rest:02d}"
""",
                """    dollars, rest = divmod(abs(cents), 100)
    if cents < 0:
        dollars = -dollars
    return f"${dollars:,}.{rest:02d}"
""",
                "format_cents(-150) gives '$-1.50'; negative amounts should read '-$1.50'.",
                """

def test_format_negative():
    assert format_cents(-150) == "-$1.50"
""",
            ),
        ),
    ),
    Spec(
        "grid",
        "matrix",
        '''"""Lists of rows as matrices."""


def transpose(rows):
    return [[rows[r][c] for r in range(len(rows))] for c in range(len(rows[0]))]


def identity(n):
    return [[1 if r == c else 0 for c in range(n)] for r in range(n)]


def matmul(a, b):
    return [[sum(x * y for x, y in zip(row, col)) for col in transpose(b)] for row in a]
''',
        """from grid.matrix import identity, matmul, transpose


def test_transpose_square():
    assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]


def test_identity():
    assert identity(2) == [[1, 0], [0, 1]]


def test_matmul_identity():
    assert matmul([[1, 2], [3, 4]], identity(2)) == [[1, 2], [3, 4]]
""",
        (
            Bug(
                "    return [[rows[r][c] for r in range(len(rows))] for c in range(len(rows[0]))]\n",
                "    return [[rows[r][c] for r in range(len(rows))] for c in range(len(rows))]\n",
                "transpose breaks on matrices that are not square: transpose([[1, 2, 3]]) should be "
                "[[1], [2], [3]].",
                """

def test_transpose_wide():
    assert transpose([[1, 2, 3]]) == [[1], [2], [3]]
""",
            ),
        ),
    ),
    Spec(
        "wordfreq",
        "counts",
        '''"""Word frequencies."""

import re
from collections import Counter


def tokenize(text):
    return re.findall(r"[a-z']+", text.lower())


def top_words(text, n):
    """The n most frequent words, most frequent first, ties in alphabetical order."""
    counts = Counter(tokenize(text))
    return sorted(counts, key=lambda word: (-counts[word], word))[:n]
''',
        """from wordfreq.counts import tokenize, top_words


def test_tokenize():
    assert tokenize("It's a Test, a test!") == ["it's", "a", "test", "a", "test"]


def test_top_words_by_count():
    assert top_words("b b b a a c", 2) == ["b", "a"]
""",
        (
            Bug(
                "    return sorted(counts, key=lambda word: (-counts[word], word))[:n]\n",
                "    return sorted(counts, key=lambda word: counts[word], reverse=True)[:n]\n",
                "top_words breaks ties by first appearance instead of alphabetically: "
                "top_words('pear apple', 2) should be ['apple', 'pear'].",
                """

def test_ties_are_alphabetical():
    assert top_words("pear apple", 2) == ["apple", "pear"]
""",
            ),
        ),
    ),
    Spec(
        "searching",
        "bsearch",
        '''"""Binary search over sorted lists."""


def find_first(items, target):
    """Index of the first occurrence of target in sorted items, or -1."""
    lo, hi = 0, len(items)
    while lo < hi:
        mid = (lo + hi) // 2
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < len(items) and items[lo] == target else -1


def insert_sorted(items, value):
    index = 0
    while index < len(items) and items[index] <= value:
        index += 1
    return items[:index] + [value] + items[index:]
''',
        """from searching.bsearch import find_first, insert_sorted


def test_find_unique():
    assert find_first([1, 3, 5, 7], 5) == 2


def test_find_missing():
    assert find_first([1, 3, 5], 4) == -1


def test_insert_sorted():
    assert insert_sorted([1, 3, 5], 4) == [1, 3, 4, 5]
""",
        (
            Bug(
                """    lo, hi = 0, len(items)
    while lo < hi:
        mid = (lo + hi) // 2
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < len(items) and items[lo] == target else -1
""",
                """    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
""",
                "find_first returns some occurrence, not the first: find_first([2, 2, 2, 2, 3], 2) should "
                "be 0.",
                """

def test_find_first_of_duplicates():
    assert find_first([2, 2, 2, 2, 3], 2) == 0
""",
            ),
        ),
    ),
    Spec(
        "csvlite",
        "fields",
        '''"""One CSV line at a time."""


def parse_line(line):
    """Fields of one line; quoted fields may hold commas and doubled quotes."""
    fields, current, quoted, i = [], [], False, 0
    while i < len(line):
        ch = line[i]
        if quoted:
            if ch == '"' and i + 1 < len(line) and line[i + 1] == '"':
                current.append('"')
                i += 1
            elif ch == '"':
                quoted = False
            else:
                current.append(ch)
        elif ch == '"':
            quoted = True
        elif ch == ",":
            fields.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    fields.append("".join(current))
    return fields


def to_line(fields):
    def quote(field):
        if any(c in field for c in ',"'):
            return '"' + field.replace('"', '""') + '"'
        return field

    return ",".join(quote(f) for f in fields)
''',
        """from csvlite.fields import parse_line, to_line


def test_plain():
    assert parse_line("a,b,c") == ["a", "b", "c"]


def test_quoted_comma():
    assert parse_line('"a,b",c') == ["a,b", "c"]


def test_to_line_quotes():
    assert to_line(["a,b", "c"]) == '"a,b",c'
""",
        (
            Bug(
                """            if ch == '"' and i + 1 < len(line) and line[i + 1] == '"':
                current.append('"')
                i += 1
            elif ch == '"':
""",
                """            if ch == '"':
""",
                'parse_line loses doubled quotes inside quoted fields: parse_line(\'"say ""hi""",x\') should '
                "be ['say \"hi\"', 'x'].",
                '''

def test_doubled_quotes():
    assert parse_line('"say ""hi""",x') == ['say "hi"', "x"]


def test_round_trip():
    fields = ['he said "no"', "plain"]
    assert parse_line(to_line(fields)) == fields
''',
            ),
        ),
    ),
    Spec(
        "thermo",
        "convert",
        '''"""Temperature conversions."""


def c_to_f(celsius):
    return celsius * 9 / 5 + 32


def f_to_c(fahrenheit):
    return (fahrenheit - 32) * 5 / 9


def c_to_k(celsius):
    return celsius + 273.15
''',
        """from thermo.convert import c_to_f, c_to_k


def test_c_to_f():
    assert c_to_f(100) == 212


def test_c_to_k():
    assert c_to_k(0) == 273.15
""",
        (
            Bug(
                "    return (fahrenheit - 32) * 5 / 9\n",
                "    return (fahrenheit - 32) * 9 / 5\n",
                "f_to_c is wrong: f_to_c(212) should be 100.",
                """from thermo.convert import c_to_f, f_to_c


def test_f_to_c():
    assert f_to_c(212) == 100
    assert abs(f_to_c(c_to_f(37.5)) - 37.5) < 1e-9
""",
                new_file=True,
            ),
        ),
    ),
    Spec(
        "pathkit",
        "paths",
        '''"""POSIX path helpers."""


def normalize(path):
    """Collapse '.', '..' and repeated slashes; '..' past the start of a relative path is kept."""
    absolute = path.startswith("/")
    parts = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts and parts[-1] != "..":
                parts.pop()
            elif not absolute:
                parts.append("..")
            continue
        parts.append(part)
    joined = "/".join(parts)
    return "/" + joined if absolute else (joined or ".")


def join(*parts):
    return normalize("/".join(parts))
''',
        """from pathkit.paths import join, normalize


def test_collapse():
    assert normalize("a/./b//c/../d") == "a/b/d"


def test_absolute():
    assert normalize("/a/../../b") == "/b"


def test_join():
    assert join("a", "b", "../c") == "a/c"
""",
        (
            Bug(
                """            elif not absolute:
                parts.append("..")
""",
                "",
                "normalize drops a leading '..' of a relative path: normalize('../a') gives 'a' but should "
                "give '../a'.",
                """

def test_leading_parent_kept():
    assert normalize("../a") == "../a"
    assert normalize("a/../../b") == "../b"
""",
            ),
        ),
    ),
    Spec(
        "rle",
        "codec",
        '''"""Run-length encoding: 'aaab' <-> '3a1b'."""

import re


def encode(text):
    out = []
    i = 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{j - i}{text[i]}")
        i = j
    return "".join(out)


def decode(encoded):
    return "".join(char * int(count) for count, char in re.findall(r"(\\d+)(\\D)", encoded))
''',
        """from rle.codec import decode, encode


def test_encode():
    assert encode("aaab") == "3a1b"


def test_decode_short_runs():
    assert decode("3a1b") == "aaab"
""",
        (
            Bug(
                """    return "".join(char * int(count) for count, char in re.findall(r"(\\d+)(\\D)", encoded))
""",
                """    return "".join(char * int(count) for count, char in re.findall(r"(\\d)(\\D)", encoded))
""",
                "decode fails on runs of ten or more: decode('12a') should be twelve 'a's.",
                """

def test_decode_long_runs():
    assert decode("12a") == "a" * 12
    assert decode(encode("x" * 25 + "y")) == "x" * 25 + "y"
""",
            ),
        ),
    ),
    Spec(
        "primes",
        "sieve",
        '''"""Prime numbers."""


def primes_up_to(n):
    """Every prime p with p <= n."""
    if n < 2:
        return []
    is_prime = [True] * (n + 1)
    is_prime[0] = is_prime[1] = False
    for p in range(2, int(n**0.5) + 1):
        if is_prime[p]:
            for multiple in range(p * p, n + 1, p):
                is_prime[multiple] = False
    return [p for p in range(2, n + 1) if is_prime[p]]


def is_prime(n):
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))
''',
        """from primes.sieve import is_prime, primes_up_to


def test_small_primes():
    assert primes_up_to(10) == [2, 3, 5, 7]


def test_is_prime():
    assert is_prime(97) and not is_prime(91)
""",
        (
            Bug(
                "    return [p for p in range(2, n + 1) if is_prime[p]]\n",
                "    return [p for p in range(2, n) if is_prime[p]]\n",
                "primes_up_to(13) leaves out 13; the bound is inclusive.",
                """

def test_bound_is_inclusive():
    assert primes_up_to(13) == [2, 3, 5, 7, 11, 13]
""",
            ),
        ),
    ),
    Spec(
        "versions",
        "semver",
        '''"""Dotted version numbers."""


def parse_version(text):
    return tuple(int(part) for part in text.split("."))


def compare_versions(a, b):
    """-1, 0 or 1 as version a is older than, equal to or newer than b."""
    left, right = parse_version(a), parse_version(b)
    width = max(len(left), len(right))
    left += (0,) * (width - len(left))
    right += (0,) * (width - len(right))
    return (left > right) - (left < right)
''',
        """from versions.semver import compare_versions, parse_version


def test_parse():
    assert parse_version("1.2.3") == (1, 2, 3)


def test_compare_simple():
    assert compare_versions("1.2", "1.3") == -1
    assert compare_versions("2.0", "2.0") == 0
""",
        (
            Bug(
                "    left, right = parse_version(a), parse_version(b)\n",
                '    left, right = tuple(a.split(".")), tuple(b.split("."))\n',
                "compare_versions('1.10', '1.9') says 1.10 is older; version parts must compare as numbers.",
                """

def test_compare_numerically():
    assert compare_versions("1.10", "1.9") == 1
    assert compare_versions("2.0", "2.0.0") == 0
""",
            ),
        ),
    ),
    Spec(
        "ciphers",
        "caesar",
        '''"""The Caesar cipher."""

import string


def shift(text, k):
    out = []
    for ch in text:
        if ch in string.ascii_lowercase:
            out.append(chr((ord(ch) - ord("a") + k) % 26 + ord("a")))
        elif ch in string.ascii_uppercase:
            out.append(chr((ord(ch) - ord("A") + k) % 26 + ord("A")))
        else:
            out.append(ch)
    return "".join(out)


def unshift(text, k):
    return shift(text, -k)
''',
        """from ciphers.caesar import shift, unshift


def test_shift_lower():
    assert shift("xyz", 3) == "abc"


def test_round_trip_lower():
    assert unshift(shift("hello, world", 5), 5) == "hello, world"
""",
        (
            Bug(
                '            out.append(chr((ord(ch) - ord("A") + k) % 26 + ord("A")))\n',
                "            out.append(chr(ord(ch) + k))\n",
                "shift does not wrap capital letters: shift('XYZ', 3) should be 'ABC'.",
                """

def test_shift_upper_wraps():
    assert shift("XYZ", 3) == "ABC"
    assert unshift(shift("Hello", 13), 13) == "Hello"
""",
            ),
        ),
    ),
    Spec(
        "statskit",
        "summary",
        '''"""Summary statistics."""

from collections import Counter


def mean(values):
    return sum(values) / len(values)


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def mode(values):
    return Counter(values).most_common(1)[0][0]
''',
        """from statskit.summary import mean, median, mode


def test_mean():
    assert mean([1, 2, 6]) == 3


def test_median_odd():
    assert median([5, 1, 3]) == 3


def test_mode():
    assert mode([1, 2, 2, 3]) == 2
""",
        (
            Bug(
                "    return (ordered[middle - 1] + ordered[middle]) / 2\n",
                "    return ordered[middle]\n",
                "median of an even number of values should average the two middle ones: median([1, 2, 3, 4]) "
                "is 2.5, not 3.",
                """

def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5
""",
            ),
        ),
    ),
    Spec(
        "bank",
        "account",
        '''"""A bank account."""


class Account:
    def __init__(self, balance=0):
        self.balance = balance

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount

    def withdraw(self, amount):
        if amount <= 0:
            raise ValueError("withdrawal must be positive")
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balance -= amount
''',
        """import pytest

from bank.account import Account


def test_deposit():
    account = Account()
    account.deposit(10)
    assert account.balance == 10


def test_withdraw():
    account = Account(10)
    account.withdraw(4)
    assert account.balance == 6


def test_negative_deposit_refused():
    with pytest.raises(ValueError):
        Account().deposit(-1)
""",
        (
            Bug(
                """        if amount > self.balance:
            raise ValueError("insufficient funds")
""",
                "",
                "Account.withdraw lets the balance go negative; withdrawing more than the balance must raise "
                "ValueError and leave the balance as it was.",
                """

def test_overdraft_refused():
    account = Account(5)
    with pytest.raises(ValueError):
        account.withdraw(6)
    assert account.balance == 5
""",
            ),
        ),
    ),
    Spec(
        "inventory",
        "stock",
        '''"""Stock counts as dictionaries."""


def merge_counts(a, b):
    merged = dict(a)
    for item, count in b.items():
        merged[item] = merged.get(item, 0) + count
    return merged


def total(counts):
    return sum(counts.values())
''',
        """from inventory.stock import merge_counts, total


def test_merge_shared_keys():
    assert merge_counts({"a": 1}, {"a": 2}) == {"a": 3}


def test_total():
    assert total({"a": 1, "b": 2}) == 3
""",
        (
            Bug(
                """    for item, count in b.items():
        merged[item] = merged.get(item, 0) + count
""",
                """    for item in merged:
        merged[item] += b.get(item, 0)
""",
                "merge_counts drops items only the second inventory has: merge_counts({'a': 1}, {'b': 2}) "
                "should be {'a': 1, 'b': 2}.",
                """

def test_merge_keeps_new_items():
    assert merge_counts({"a": 1}, {"b": 2}) == {"a": 1, "b": 2}
""",
            ),
        ),
    ),
    Spec(
        "palin",
        "check",
        '''"""Palindromes."""


def is_palindrome(text):
    """True when text reads the same backwards, ignoring case and anything but letters and digits."""
    cleaned = [ch.lower() for ch in text if ch.isalnum()]
    return cleaned == cleaned[::-1]


def reverse_words(text):
    return " ".join(reversed(text.split()))
''',
        """from palin.check import is_palindrome, reverse_words


def test_simple_palindrome():
    assert is_palindrome("racecar") and not is_palindrome("python")


def test_reverse_words():
    assert reverse_words("a b c") == "c b a"
""",
        (
            Bug(
                "    cleaned = [ch.lower() for ch in text if ch.isalnum()]\n",
                "    cleaned = [ch for ch in text if ch.isalnum()]\n",
                "is_palindrome('Racecar') is False; case should not matter.",
                """

def test_ignores_case_and_punctuation():
    assert is_palindrome("Racecar")
    assert is_palindrome("A man, a plan, a canal: Panama")
""",
            ),
        ),
    ),
    Spec(
        "fizz",
        "game",
        '''"""FizzBuzz."""


def fizzbuzz(n):
    out = []
    for i in range(1, n + 1):
        if i % 15 == 0:
            out.append("FizzBuzz")
        elif i % 3 == 0:
            out.append("Fizz")
        elif i % 5 == 0:
            out.append("Buzz")
        else:
            out.append(str(i))
    return out
''',
        """from fizz.game import fizzbuzz


def test_first_five():
    assert fizzbuzz(5) == ["1", "2", "Fizz", "4", "Buzz"]
""",
        (
            Bug(
                """        if i % 15 == 0:
            out.append("FizzBuzz")
        elif i % 3 == 0:
            out.append("Fizz")
""",
                """        if i % 3 == 0:
            out.append("Fizz")
        elif i % 15 == 0:
            out.append("FizzBuzz")
""",
                "fizzbuzz(15)[-1] is 'Fizz'; multiples of 15 should say 'FizzBuzz'.",
                """

def test_fifteen():
    assert fizzbuzz(15)[-1] == "FizzBuzz"
""",
            ),
        ),
    ),
    Spec(
        "retrying",
        "backoff",
        '''"""Retry delays."""


def backoff_delays(base, factor, attempts, cap):
    """Delays before each retry: base, base * factor, ... each at most cap."""
    return [min(cap, base * factor**i) for i in range(attempts)]


def total_wait(base, factor, attempts, cap):
    return sum(backoff_delays(base, factor, attempts, cap))
''',
        """from retrying.backoff import backoff_delays


def test_grows():
    assert backoff_delays(1, 2, 4, 100) == [1, 2, 4, 8]
""",
        (
            Bug(
                "    return [min(cap, base * factor**i) for i in range(attempts)]\n",
                "    return [base * factor**i for i in range(attempts)]\n",
                "backoff_delays ignores cap: backoff_delays(1, 2, 5, 5) should be [1, 2, 4, 5, 5].",
                """from retrying.backoff import backoff_delays, total_wait


def test_capped():
    assert backoff_delays(1, 2, 5, 5) == [1, 2, 4, 5, 5]
    assert total_wait(1, 2, 5, 5) == 17
""",
                new_file=True,
            ),
        ),
    ),
    Spec(
        "dotpath",
        "lookup",
        '''"""Looking values up in nested data with dotted paths."""


def get_path(data, path, default=None):
    """data["a"]["b"][0] for "a.b.0"; default when any step is missing."""
    current = data
    for key in path.split("."):
        if isinstance(current, list):
            if not key.isdigit() or int(key) >= len(current):
                return default
            current = current[int(key)]
        elif isinstance(current, dict) and key in current:
            current = current[key]
        else:
            return default
    return current


def set_path(data, path, value):
    *parents, last = path.split(".")
    current = data
    for key in parents:
        current = current.setdefault(key, {})
    current[last] = value
    return data
''',
        """from dotpath.lookup import get_path, set_path


def test_nested_dicts():
    assert get_path({"a": {"b": 1}}, "a.b") == 1


def test_missing_gives_default():
    assert get_path({"a": {}}, "a.b", 7) == 7


def test_set_path():
    assert set_path({}, "a.b", 2) == {"a": {"b": 2}}
""",
        (
            Bug(
                """        if isinstance(current, list):
            if not key.isdigit() or int(key) >= len(current):
                return default
            current = current[int(key)]
        elif isinstance(current, dict) and key in current:
""",
                """        if isinstance(current, dict) and key in current:
""",
                "get_path cannot index lists: get_path({'a': [10, 20]}, 'a.1') should be 20.",
                """

def test_list_indices():
    assert get_path({"a": [10, 20]}, "a.1") == 20
    assert get_path({"a": [10]}, "a.3", "none") == "none"
""",
            ),
        ),
    ),
)
