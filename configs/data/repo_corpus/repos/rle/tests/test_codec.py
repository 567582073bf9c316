from rle.codec import decode, encode


def test_encode():
    assert encode("aaab") == "3a1b"


def test_decode_short_runs():
    assert decode("3a1b") == "aaab"
