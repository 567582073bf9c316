"""Roman numerals."""

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
