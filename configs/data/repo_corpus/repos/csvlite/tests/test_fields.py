from csvlite.fields import parse_line, to_line


def test_plain():
    assert parse_line("a,b,c") == ["a", "b", "c"]


def test_quoted_comma():
    assert parse_line('"a,b",c') == ["a,b", "c"]


def test_to_line_quotes():
    assert to_line(["a,b", "c"]) == '"a,b",c'
