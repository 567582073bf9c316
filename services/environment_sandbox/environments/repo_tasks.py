"""Repository tasks: SWE-bench-style JSONL over local repositories, and Harbor-style task directories.

A task is a repository snapshot, a problem statement, and how it is judged. Both sources become the
same task JSON (what the `repo` environment takes and the gateway's dataset indexes):

    {"instance_id", "repo": <local path>, "base_commit", "problem_statement",
     "patch" (the known fix, for the oracle), "hidden_files" (path -> text laid over the final
     workspace when it is scored), "FAIL_TO_PASS", "PASS_TO_PASS", "test_command"}        (swe)
    {"instance_id", "repo", "problem_statement", "tests" (path -> text, bound at /tests when scored),
     "solution" (solve.sh), "agent_timeout_s", "verifier_timeout_s"}                          (harbor)

SWE-bench JSONL (instance_id, repo, base_commit, problem_statement, patch, test_patch, FAIL_TO_PASS,
PASS_TO_PASS; the two lists may be JSON strings, as the published dataset has them): `repo` is a
local directory or archive (relative paths resolve against the JSONL file's directory), or a name
("owner/name") found under `repos_root` as owner__name or owner/name. A git repository is
exported at base_commit. `test_patch` is applied here, on the host, to the base revision's test
files: the hidden tests are whole files, so nothing the agent did to them survives scoring.

Harbor task directory (task.toml, instruction.md, environment/, tests/test.sh, solution/solve.sh):
the workspace is environment/workspace/ when present, else environment/ (its Dockerfile is not
built: commands run with the sandbox's runtime); tests/ is uploaded to /tests only in the scoring
fork, where `bash /tests/test.sh` writes the reward to /logs/verifier/reward.txt or reward.json.

In the environment-sandbox every path a recipe or a task names (the task file or directory, each
repository, a Harbor workspace, a file under tests/) must lie inside the service's data or plugin
directories, or the project's shipped configs/data, symlinks and '..' resolved, as a [dataset]
path must (run_dataset.py): outside, it answers as a missing one. A recipe can thereby neither
copy host files nor another tenant's repositories into its agent's workspace (`confine`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import tempfile
import tomllib
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.environment_sandbox.environments.base import EnvironmentError_
from services.environment_sandbox.environments.datasets import load_jsonl
from services.environment_sandbox.sandbox.ws_tools import PatchError, apply_patch_text, inside, parse_patch

DEFAULT_TEST_COMMAND = "python -P -m pytest -rA -q -p no:cacheprovider --tb=short"
MAX_HIDDEN_FILE_BYTES = 4 << 20
SHIPPED_DATA = Path(__file__).resolve().parents[3] / "configs" / "data"
# Where tasks may read (None: anywhere, for the library used in-process; the service confines it).
_ROOTS: list[tuple[Path, ...] | None] = [None]


def confine(roots: Sequence[Path] | None) -> None:
    """Read tasks and repositories only inside `roots` and the shipped configs/data (None: anywhere)."""
    _ROOTS[0] = None if roots is None else (*(Path(r).resolve() for r in roots), SHIPPED_DATA)


def allowed(path: str | Path) -> Path | None:
    """The path resolved when tasks may read it (it exists, inside the roots), else None."""
    try:
        resolved = Path(path).resolve()
        if not resolved.exists():
            return None
    except (OSError, ValueError):  # a name no file can have (a NUL byte, too long)
        return None
    roots = _ROOTS[0]
    if roots is None or any(resolved == r or resolved.is_relative_to(r) for r in roots):
        return resolved
    return None


def where_allowed() -> str:
    roots = _ROOTS[0]
    return "" if roots is None else f" in the data directories ({', '.join(str(r) for r in roots)})"


def _id_list(value: Any, where: str) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError:
            raise EnvironmentError_(f"{where}: not a JSON list of test ids") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise EnvironmentError_(f"{where}: must be a list of test ids")
    return list(value)


def _resolve_repo(repo: str, base_dir: Path, repos_root: str, where: str) -> str:
    candidates = [Path(repo) if os.path.isabs(repo) else base_dir / repo]
    if repos_root:
        candidates += [Path(repos_root) / repo.replace("/", "__"), Path(repos_root) / repo]
    for candidate in candidates:
        found = allowed(candidate)
        if found is not None:
            return str(found)
    hint = "" if repos_root else " (set environment.config.repos_root to where repositories are checked out)"
    raise EnvironmentError_(
        f"{where}.repo: {repo!r} is not a local directory or archive{where_allowed()}{hint}"
    )


def _base_file(repo: str, commit: str, rel: str) -> str | None:
    """The file at the base revision, or None when it does not exist there."""
    path = Path(repo)
    if path.is_dir() and commit:
        found = subprocess.run(["git", "-C", repo, "show", f"{commit}:{rel}"], capture_output=True)
        return found.stdout.decode() if found.returncode == 0 else None
    if path.is_dir():
        target = allowed(path / rel)  # a symlink out of the repository reads nothing
        if target is None or not target.is_relative_to(path.resolve()) or not target.is_file():
            return None
        return target.read_text()
    if path.name.endswith(".zip"):
        with zipfile.ZipFile(path) as zf:
            names = {n.split("/", 1)[-1] if _single_root(zf.namelist()) else n: n for n in zf.namelist()}
            return zf.read(names[rel]).decode() if rel in names else None
    with tarfile.open(path) as tf:
        for member in tf.getmembers():
            if member.isfile() and member.name.lstrip("./") == rel:
                extracted = tf.extractfile(member)
                return extracted.read().decode() if extracted else None
    return None


def _single_root(names: list[str]) -> bool:
    return len({n.split("/", 1)[0] for n in names}) == 1 and all("/" in n for n in names)


def hidden_files(repo: str, commit: str, test_patch: str, where: str) -> dict[str, str]:
    """The files test_patch touches, as they are after applying it to the base revision."""
    if not test_patch.strip():
        return {}
    try:
        patches = parse_patch(test_patch)
    except PatchError as exc:
        raise EnvironmentError_(f"{where}.test_patch: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="looprl-hidden-") as scratch:
        for patch in patches:
            try:  # paths of the repository: neither absolute nor climbing out of it
                for rel in filter(None, (patch.old_path, patch.new_path)):
                    inside(scratch, rel)
            except PatchError as exc:
                raise EnvironmentError_(f"{where}.test_patch: {exc}") from None
            if patch.old_path:
                original = _base_file(repo, commit, patch.old_path)
                if original is not None:
                    target = Path(scratch, patch.old_path)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(original)
        try:
            changed = apply_patch_text(scratch, test_patch)
        except PatchError as exc:
            raise EnvironmentError_(
                f"{where}.test_patch: does not apply to the base revision: {exc}"
            ) from None
        files = {}
        for rel in changed:
            target = Path(scratch, rel)
            if target.is_file():
                if target.stat().st_size > MAX_HIDDEN_FILE_BYTES:
                    raise EnvironmentError_(
                        f"{where}.test_patch: {rel} is larger than {MAX_HIDDEN_FILE_BYTES} bytes"
                    )
                files[rel] = target.read_text()
        return files


def swe_task(row: dict[str, Any], base_dir: Path, repos_root: str, where: str) -> dict[str, Any]:
    """One SWE-bench-style row as a task (see the module docstring)."""
    for key in ("instance_id", "repo", "problem_statement"):
        if not isinstance(row.get(key), str) or not row[key]:
            raise EnvironmentError_(f"{where}.{key}: must be a non-empty string")
    repo = _resolve_repo(row["repo"], base_dir, repos_root, where)
    commit = str(row.get("base_commit") or "")
    f2p = _id_list(row.get("FAIL_TO_PASS", []), f"{where}.FAIL_TO_PASS")
    if not f2p:
        raise EnvironmentError_(
            f"{where}.FAIL_TO_PASS: a task needs at least one test that must start passing"
        )
    return {
        "kind": "swe",
        "instance_id": row["instance_id"],
        "repo": repo,
        "base_commit": commit if Path(repo).is_dir() and (Path(repo) / ".git").exists() else "",
        "problem_statement": row["problem_statement"],
        "patch": str(row.get("patch") or ""),
        "hidden_files": hidden_files(repo, commit, str(row.get("test_patch") or ""), where),
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": _id_list(row.get("PASS_TO_PASS", []), f"{where}.PASS_TO_PASS"),
        "test_command": str(row.get("test_command") or DEFAULT_TEST_COMMAND),
    }


def load_swe_jsonl(path: str | Path, repos_root: str = "") -> list[dict[str, Any]]:
    base_dir = Path(path).resolve().parent
    return [swe_task(row, base_dir, repos_root, f"{path}:{n}") for n, row in enumerate(load_jsonl(path), 1)]


def _read_tree(root: Path) -> dict[str, str]:
    """The files under `root`; one that resolves outside the roots (a symlink out) is refused."""
    files = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file() or "__pycache__" in p.parts:
            continue
        if allowed(p) is None:
            raise EnvironmentError_(f"{p}: not a file{where_allowed()}")
        files[str(p.relative_to(root))] = p.read_text()
    return files


def harbor_task(directory: Path) -> dict[str, Any]:
    """One Harbor-style task directory as a task (see the module docstring)."""
    where = str(directory)
    try:
        config = tomllib.loads((directory / "task.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise EnvironmentError_(f"{where}/task.toml: {exc}") from None
    instruction = directory / "instruction.md"
    if not instruction.is_file():
        raise EnvironmentError_(f"{where}/instruction.md: missing (the agent's instruction)")
    environment = directory / "environment"
    workspace = environment / "workspace" if (environment / "workspace").is_dir() else environment
    if not workspace.is_dir() or allowed(workspace) is None:
        raise EnvironmentError_(f"{where}/environment: missing (the workspace's starting state)")
    if not (directory / "tests" / "test.sh").is_file():
        raise EnvironmentError_(f"{where}/tests/test.sh: missing (the verifier)")
    solve = directory / "solution" / "solve.sh"
    name = config.get("task", {}).get("name") or directory.name
    return {
        "kind": "harbor",
        "instance_id": str(name),
        "repo": str(workspace.resolve()),
        "base_commit": "",
        "problem_statement": instruction.read_text(),
        "tests": _read_tree(directory / "tests"),
        "solution": solve.read_text() if solve.is_file() else "",
        "agent_timeout_s": float(config.get("agent", {}).get("timeout_sec", 0) or 0),
        "verifier_timeout_s": float(config.get("verifier", {}).get("timeout_sec", 0) or 0),
    }


def load_harbor(path: str | Path) -> list[dict[str, Any]]:
    """One task directory, or a directory of them (each subdirectory holding a task.toml)."""
    root = Path(path)
    if (root / "task.toml").is_file():
        return [harbor_task(root)]
    tasks = [harbor_task(d) for d in sorted(root.iterdir()) if (d / "task.toml").is_file()]
    if not tasks:
        raise EnvironmentError_(f"{path}: no task.toml in it or in its subdirectories")
    return tasks


def load_repo_tasks(path: str, repos_root: str = "") -> list[dict[str, Any]]:
    """Tasks from a SWE-bench-style JSONL file or Harbor-style task directories."""
    if allowed(path) is None:
        raise EnvironmentError_(f"environment.config.dataset: {path!r} does not exist{where_allowed()}")
    if os.path.isdir(path):
        return load_harbor(path)
    if path.endswith((".jsonl", ".json")):
        return load_swe_jsonl(path, repos_root)
    raise EnvironmentError_(
        f"environment.config.dataset: {path!r} is neither a JSONL file nor a directory of Harbor tasks"
    )
