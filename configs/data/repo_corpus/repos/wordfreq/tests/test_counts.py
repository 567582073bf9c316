from wordfreq.counts import tokenize, top_words


def test_tokenize():
    assert tokenize("It's a Test, a test!") == ["it's", "a", "test", "a", "test"]


def test_top_words_by_count():
    assert top_words("b b b a a c", 2) == ["b", "a"]
