"""Which paths namespace hosts bind into their private /tmp (bench/harness/netns_hosts.py): those
under /tmp, relative to it, a path inside another only once."""

from __future__ import annotations

import sys

import pytest

from bench.harness.netns_hosts import REPO_ROOT, default_shared_paths, under_tmp


def test_only_paths_under_tmp_are_bound_and_nested_ones_once():
    paths = ["/tmp/x45", "/tmp/x45/.venv", "/usr/local", "/var/tmp/y", "/tmp/other/venv", "/tmpfoo/z"]
    assert under_tmp(paths) == ["other/venv", "x45"]


def test_tmp_itself_cannot_be_shared():
    with pytest.raises(ValueError, match="private /tmp"):
        under_tmp(["/tmp/"])


def test_the_checkout_and_its_environment_are_shared_by_default():
    shared = default_shared_paths()
    assert str(REPO_ROOT) in shared and sys.prefix in shared
    assert (REPO_ROOT / "bench" / "harness" / "netns_hosts.py").is_file()
