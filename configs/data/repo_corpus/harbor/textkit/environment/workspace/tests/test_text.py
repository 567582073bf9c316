from textkit.text import count_words, slugify, title_case


def test_slugify_joins_words():
    assert slugify("Hello World") == "hello-world"


def test_count_words():
    assert count_words("a b  c") == 3


def test_title_case():
    assert title_case("hello wORLD") == "Hello World"
