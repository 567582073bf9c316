"""Run-length encoding: 'aaab' <-> '3a1b'."""

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
    return "".join(char * int(count) for count, char in re.findall(r"(\d)(\D)", encoded))
