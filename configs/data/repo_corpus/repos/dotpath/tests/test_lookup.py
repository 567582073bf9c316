from dotpath.lookup import get_path, set_path


def test_nested_dicts():
    assert get_path({"a": {"b": 1}}, "a.b") == 1


def test_missing_gives_default():
    assert get_path({"a": {}}, "a.b", 7) == 7


def test_set_path():
    assert set_path({}, "a.b", 2) == {"a": {"b": 2}}
