from pathkit.paths import join, normalize


def test_collapse():
    assert normalize("a/./b//c/../d") == "a/b/d"


def test_absolute():
    assert normalize("/a/../../b") == "/b"


def test_join():
    assert join("a", "b", "../c") == "a/c"


def test_leading_parent_kept():
    assert normalize("../a") == "../a"
    assert normalize("a/../../b") == "../b"
