"""Small text helpers."""

import re


def slugify(text):
    """Lower-case words joined by single hyphens, nothing else."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower())
    return slug.lstrip("-")


def count_words(text):
    return len(text.split())


def title_case(text):
    return " ".join(word[:1].upper() + word[1:].lower() for word in text.split())
