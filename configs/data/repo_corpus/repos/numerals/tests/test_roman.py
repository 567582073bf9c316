from numerals.roman import from_roman, to_roman


def test_to_roman_simple():
    assert to_roman(1987) == "MCMLXXXVII"


def test_from_roman():
    assert from_roman("MCMXCIV") == 1994
