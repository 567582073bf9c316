"""The Caesar cipher."""

import string


def shift(text, k):
    out = []
    for ch in text:
        if ch in string.ascii_lowercase:
            out.append(chr((ord(ch) - ord("a") + k) % 26 + ord("a")))
        elif ch in string.ascii_uppercase:
            out.append(chr(ord(ch) + k))
        else:
            out.append(ch)
    return "".join(out)


def unshift(text, k):
    return shift(text, -k)
