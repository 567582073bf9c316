"""Word frequencies."""

import re
from collections import Counter


def tokenize(text):
    return re.findall(r"[a-z']+", text.lower())


def top_words(text, n):
    """The n most frequent words, most frequent first, ties in alphabetical order."""
    counts = Counter(tokenize(text))
    return sorted(counts, key=lambda word: counts[word], reverse=True)[:n]
