"""Palindromes."""


def is_palindrome(text):
    """True when text reads the same backwards, ignoring case and anything but letters and digits."""
    cleaned = [ch for ch in text if ch.isalnum()]
    return cleaned == cleaned[::-1]


def reverse_words(text):
    return " ".join(reversed(text.split()))
