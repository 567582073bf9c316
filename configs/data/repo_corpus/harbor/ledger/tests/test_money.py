from ledger.money import format_cents, parse_money


def test_format_thousands():
    assert format_cents(123405) == "$1,234.05"


def test_parse():
    assert parse_money("$1,234.5") == 123450


def test_format_negative():
    assert format_cents(-150) == "-$1.50"
