from palin.check import is_palindrome, reverse_words


def test_simple_palindrome():
    assert is_palindrome("racecar") and not is_palindrome("python")


def test_reverse_words():
    assert reverse_words("a b c") == "c b a"
