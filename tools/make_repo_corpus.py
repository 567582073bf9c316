"""Build, offline and deterministically, the repository-task corpus the `repo` environment ships with.

    python tools/make_repo_corpus.py [--out configs/data/repo_corpus] [--check]

From tools/repo_corpus_specs.py (one small Python package per spec, with a bug planted in it) this
writes

    repos/<package>/          the repository at its base revision: the bug in place, visible tests
    tasks.jsonl               one SWE-bench-style row per repository: instance_id, repo (relative to
                              the file), base_commit (empty: a plain directory), problem_statement,
                              patch (the fix), test_patch (the hidden tests), FAIL_TO_PASS,
                              PASS_TO_PASS
    harbor/<package>/         some of the same tasks as Harbor-style directories (task.toml,
                              instruction.md, environment/, tests/test.sh, solution/solve.sh)

and checks every task before writing anything: the visible tests pass with and without the bug,
the hidden tests fail with it and pass with the fix (run in-process on a scratch copy). `--check`
exits 1 when the files under --out differ from what it would write.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from tools.repo_corpus_specs import SPECS, Bug, Spec  # noqa: E402

DEFAULT_OUT = ROOT / "configs" / "data" / "repo_corpus"
HARBOR_EVERY = 6  # every sixth task is also written as a Harbor-style directory


def _diff(path: str, before: str | None, after: str | None) -> str:
    lines = difflib.unified_diff(
        (before or "").splitlines(keepends=True),
        (after or "").splitlines(keepends=True),
        "/dev/null" if before is None else f"a/{path}",
        "/dev/null" if after is None else f"b/{path}",
    )
    return "".join(lines)


def _test_ids(path: str, source: str) -> list[str]:
    return [
        f"{path}::{line[4:].split('(')[0]}" for line in source.splitlines() if line.startswith("def test_")
    ]


class Task:
    """One spec's task: its files at the base revision, the fix and the hidden tests."""

    def __init__(self, spec: Spec, bug: Bug) -> None:
        if spec.source.count(bug.old) != 1:
            raise ValueError(f"{spec.package}: the bug's `old` text must occur exactly once in the source")
        self.spec, self.bug = spec, bug
        self.module_path = f"{spec.package}/{spec.module}.py"
        self.visible_path = f"tests/test_{spec.module}.py"
        self.hidden_path = f"tests/test_{spec.module}_regression.py" if bug.new_file else self.visible_path
        self.buggy = spec.source.replace(bug.old, bug.new, 1)
        self.hidden_before = None if bug.new_file else spec.visible
        self.hidden_after = bug.hidden if bug.new_file else spec.visible + bug.hidden

    def base_files(self) -> dict[str, str]:
        return {
            f"{self.spec.package}/__init__.py": f'"""The {self.spec.package} package."""\n',
            self.module_path: self.buggy,
            self.visible_path: self.spec.visible,
            "README.md": f"# {self.spec.package}\n\nRun the tests with `python -m pytest`.\n",
        }

    def row(self) -> dict:
        return {
            "instance_id": f"looprl__{self.spec.package}-1",
            "repo": f"repos/{self.spec.package}",
            "base_commit": "",
            "problem_statement": self.bug.statement,
            "patch": _diff(self.module_path, self.buggy, self.spec.source),
            "test_patch": _diff(self.hidden_path, self.hidden_before, self.hidden_after),
            "FAIL_TO_PASS": _test_ids(self.hidden_path, self.bug.hidden),
            "PASS_TO_PASS": _test_ids(self.visible_path, self.spec.visible),
        }

    def harbor_files(self) -> dict[str, str]:
        name = self.spec.package
        files = {f"environment/workspace/{rel}": text for rel, text in self.base_files().items()}
        files["environment/Dockerfile"] = (
            "# looprl runs the workspace in its sandbox and does not build this image; for Harbor itself:\n"
            "FROM python:3.11-slim\nRUN pip install pytest\nCOPY workspace /workspace\nWORKDIR /workspace\n"
        )
        files["task.toml"] = (
            'version = "1.0"\n\n[task]\n'
            f'name = "looprl/{name}"\n\n[metadata]\ncategory = "debugging"\ndifficulty = "easy"\n\n'
            "[verifier]\ntimeout_sec = 120.0\n\n[agent]\ntimeout_sec = 600.0\n"
        )
        files["instruction.md"] = self.bug.statement + "\n"
        tests = {self.visible_path: self.spec.visible, self.hidden_path: self.hidden_after or ""}
        for rel, text in tests.items():
            files[f"tests/{Path(rel).name}"] = text
        files["tests/test.sh"] = (
            "#!/bin/bash\n# The hidden tests, run in the final workspace; the reward goes to /logs/verifier.\n"
            "cd /workspace\n"
            "if python -P -m pytest -q -p no:cacheprovider /tests; then reward=1; else reward=0; fi\n"
            "echo $reward > /logs/verifier/reward.txt\n"
        )
        files["solution/solve.sh"] = (
            f"#!/bin/bash\ncat > {self.module_path} <<'LOOPRL_EOF'\n{self.spec.source}LOOPRL_EOF\n"
        )
        return files


def _run_tests(root: Path, package: str, test_files: dict[str, str]) -> dict[str, bool]:
    """Test function -> passed, running `test_files` against the package under `root` in-process."""
    sys.path.insert(0, str(root))
    outcomes = {}
    try:
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]
        importlib.invalidate_caches()
        for rel, source in test_files.items():
            namespace: dict = {"__name__": f"corpus_check_{package}"}
            exec(compile(source, rel, "exec"), namespace)
            for name, fn in namespace.items():
                if name.startswith("test_") and callable(fn):
                    try:
                        fn()
                        outcomes[f"{rel}::{name}"] = True
                    except (KeyboardInterrupt, SystemExit):
                        raise
                    except BaseException:  # pytest's failures (pytest.raises) are BaseExceptions
                        outcomes[f"{rel}::{name}"] = False
    finally:
        sys.path.remove(str(root))
    return outcomes


def check(task: Task) -> None:
    """The task's promises, or ValueError naming the one broken."""
    hidden = {task.hidden_path: task.bug.hidden if task.bug.new_file else task.spec.visible + task.bug.hidden}
    visible = {task.visible_path: task.spec.visible}
    for label, source in (("buggy", task.buggy), ("fixed", task.spec.source)):
        with tempfile.TemporaryDirectory() as scratch:
            root = Path(scratch)
            for rel, text in {**task.base_files(), task.module_path: source}.items():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_text(text)
            seen = _run_tests(root, task.spec.package, visible)
            seen.update(_run_tests(root, task.spec.package, hidden))
        for test in task.row()["PASS_TO_PASS"]:
            if not seen.get(test):
                raise ValueError(f"{task.spec.package}: visible test {test} fails on the {label} code")
        for test in task.row()["FAIL_TO_PASS"]:
            if seen.get(test) != (label == "fixed"):
                raise ValueError(
                    f"{task.spec.package}: hidden test {test} does not separate buggy from fixed"
                )


def build(out: Path) -> dict[str, str]:
    """Every file of the corpus (path relative to `out` -> text), each task checked."""
    files: dict[str, str] = {}
    rows = []
    for index, spec in enumerate(SPECS):
        task = Task(spec, spec.bugs[0])
        check(task)
        rows.append(task.row())
        for rel, text in task.base_files().items():
            files[f"repos/{spec.package}/{rel}"] = text
        if index % HARBOR_EVERY == 0:
            for rel, text in task.harbor_files().items():
                files[f"harbor/{spec.package}/{rel}"] = text
    files["tasks.jsonl"] = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
    return files


def write(out: Path, files: dict[str, str]) -> None:
    for sub in ("repos", "harbor", "tasks.jsonl"):
        target = out / sub
        if target.is_dir():
            shutil.rmtree(target)
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel.endswith(".sh"):
            path.chmod(0o755)


def stale(out: Path, files: dict[str, str]) -> list[str]:
    """Paths under `out` that differ from `files` (missing, changed, or extra)."""
    present = {
        str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    wrong = [
        rel for rel, text in files.items() if not (out / rel).is_file() or (out / rel).read_text() != text
    ]
    return sorted(set(wrong) | (present - set(files)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="Output directory (replaced).")
    parser.add_argument("--check", action="store_true", help="Only compare --out with what would be written.")
    args = parser.parse_args(argv)
    files = build(args.out)
    if args.check:
        differ = stale(args.out, files)
        if differ:
            print(
                f"{args.out} is stale ({len(differ)} files differ, e.g. {differ[0]}): run tools/make_repo_corpus.py"
            )
            return 1
        print(f"{args.out}: up to date ({len(SPECS)} tasks)")
        return 0
    write(args.out, files)
    print(f"{args.out}: {len(SPECS)} tasks, {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
