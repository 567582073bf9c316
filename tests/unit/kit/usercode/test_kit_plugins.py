"""What a recipe's plugin reference can reach: only code the operator placed in a plugin directory
(or a distribution declaring a looprl entry point). A reference cannot walk from a plugin module to
what it imported (`rewards.py:os.execl`), cannot make the service import a package outside the
plugin directories (`antigravity.x:y` imports `antigravity` to look for `x`), and a file outside them
answers exactly as a missing one (no oracle of the service host's files). Plugin exceptions become
messages of bounded size, whatever their `__str__` does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.kit.usercode import plugins

REWARDS = """import os
import subprocess
from subprocess import run
from functools import partial

from scoring_helpers import shared_score


def score(prompt, completion, answer):
    return 1.0


class Scorer:
    def __call__(self, prompt, completion, answer):
        return 0.5

    def method(self, prompt, completion, answer):
        return 0.25


scorer = Scorer()
spawn = partial(subprocess.run, shell=True)
"""

HELPERS = "def shared_score(prompt, completion, answer):\n    return 0.75\n"


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("r") / "plugins"
    d.mkdir()
    (d / "rewards.py").write_text(REWARDS)
    (d / "scoring_helpers.py").write_text(HELPERS)
    return d


def _load(reference: str, d: Path) -> object:
    return plugins.load(reference, plugins.REWARDS_GROUP, (d,)).obj


@pytest.mark.parametrize(
    "reference",
    [
        "rewards.py:os.execl",  # a module the plugin imported, then a function of it
        "rewards.py:os.system",
        "rewards.py:subprocess.run",
        "rewards.py:run",  # imported by name into the plugin
        "rewards.py:spawn",  # an object of a library's type
        "rewards.py:score.__globals__",
        "rewards.py:Scorer.__init__.__globals__",
    ],
)
def test_a_reference_cannot_reach_what_a_plugin_imported(plugin_dir: Path, reference: str) -> None:
    with pytest.raises(plugins.PluginError, match=r"not code of a plugin directory|private attribute"):
        _load(reference, plugin_dir)


def test_what_the_plugin_defines_or_imports_from_its_directory_loads(plugin_dir: Path) -> None:
    assert _load("rewards.py:score", plugin_dir)("", "", "") == 1.0
    assert _load("rewards.py:scorer", plugin_dir)("", "", "") == 0.5
    assert _load("rewards.py:Scorer.method", plugin_dir)(None, "", "", "") == 0.25
    assert _load("rewards.py:shared_score", plugin_dir)("", "", "") == 0.75
    assert _load("scoring_helpers:shared_score", plugin_dir)("", "", "") == 0.75


def test_a_module_reference_outside_the_plugin_directories_imports_nothing(plugin_dir: Path) -> None:
    # `find_spec("pkg.sub")` imports `pkg` to find `sub`: the check must come first. The package is
    # a fresh one on sys.path (as site-packages is), whose import leaves a mark.
    elsewhere = plugin_dir.parent / "site"
    (elsewhere / "noisy_pkg").mkdir(parents=True)
    mark = elsewhere / "imported"
    (elsewhere / "noisy_pkg" / "__init__.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    sys.path.insert(0, str(elsewhere))
    try:
        with pytest.raises(
            plugins.PluginError, match=r"^'noisy_pkg.sub:score': module 'noisy_pkg.sub' is neither"
        ):
            _load("noisy_pkg.sub:score", plugin_dir)
        assert not mark.exists(), "the package outside the plugin directories was imported"
        assert "noisy_pkg" not in sys.modules
    finally:
        sys.path.remove(str(elsewhere))


def test_a_file_outside_the_plugin_directories_answers_as_a_missing_one(plugin_dir: Path) -> None:
    outside = plugin_dir.parent / "outside.py"
    outside.write_text("def score(p, c, a):\n    return 1.0\n")
    (plugin_dir / "link.py").symlink_to(outside)
    answers = []
    for target in (
        str(outside),
        str(plugin_dir.parent / "missing.py"),
        "../outside.py",
        "../missing.py",
        "link.py",
        "nul\x00.py",  # a name no file can have
    ):
        with pytest.raises(plugins.PluginError) as caught:
            _load(f"{target}:score", plugin_dir)
        answers.append(str(caught.value).replace(repr(target)[1:-1], "TARGET"))
    assert len(set(answers)) == 1, answers
    assert "no file" in answers[0]


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_a_plugin_exception_is_described_within_bounds_whatever_it_holds() -> None:
    try:
        raise ValueError("x" * 5_000_000)
    except ValueError as exc:
        text = plugins.describe(exc)
    assert (
        len(text) <= plugins.MAX_MESSAGE_CHARS
        and f"{Path(__file__).name}:" in text
        and ": ValueError: xxx" in text
    )
    assert "characters left out" in text
    try:
        raise _Unprintable()
    except _Unprintable as exc:
        assert plugins.describe(exc).endswith("_Unprintable: <its message could not be shown: RuntimeError>")
