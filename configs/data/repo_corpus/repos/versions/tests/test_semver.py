from versions.semver import compare_versions, parse_version


def test_parse():
    assert parse_version("1.2.3") == (1, 2, 3)


def test_compare_simple():
    assert compare_versions("1.2", "1.3") == -1
    assert compare_versions("2.0", "2.0") == 0
