"""Repository tasks without a sandbox: the diff applier, the SWE-bench JSONL and Harbor loaders (bad
input named by line and field), git repositories at a base commit, the shipped corpus being what
its tool writes, and the repo environment's config and output helpers."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from services.environment_sandbox.environments import EnvironmentError_, make_environment, repo_tasks
from services.environment_sandbox.environments.repo import pytest_outcomes, truncate
from services.environment_sandbox.environments.repo_tasks import load_repo_tasks
from services.environment_sandbox.sandbox.layers import LayerStore
from services.environment_sandbox.sandbox.ws_tools import PatchError, apply_patch_text
from tools import make_repo_corpus

CORPUS = Path(__file__).resolve().parents[3] / "configs" / "data" / "repo_corpus"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_a_diff_applies_with_shifted_hunks_and_creates_and_deletes_files(tmp_path):
    _write(tmp_path, {"a.py": "".join(f"line {i}\n" for i in range(1, 21)), "gone.py": "x\n"})
    patch = (
        "--- a/a.py\n+++ b/a.py\n@@ -3,3 +3,3 @@\n line 3\n-line 4\n+LINE 4\n line 5\n"
        "@@ -15,2 +15,3 @@\n line 15\n+inserted\n line 16\n"
        "--- /dev/null\n+++ b/new/mod.py\n@@ -0,0 +1,2 @@\n+def f():\n+    return 1\n"
        "--- a/gone.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n"
    )
    (tmp_path / "a.py").write_text("header\n" + (tmp_path / "a.py").read_text())  # every hunk is off by one
    assert sorted(apply_patch_text(str(tmp_path), patch)) == ["a.py", "gone.py", "new/mod.py"]
    lines = (tmp_path / "a.py").read_text().splitlines()
    assert lines[4] == "LINE 4" and lines[16] == "inserted"
    assert (tmp_path / "new/mod.py").read_text() == "def f():\n    return 1\n"
    assert not (tmp_path / "gone.py").exists()


def test_a_diff_that_does_not_apply_changes_nothing_and_says_which_hunk(tmp_path):
    _write(tmp_path, {"a.py": "one\ntwo\n", "b.py": "three\n"})
    patch = (
        "--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-one\n+ONE\n--- a/b.py\n+++ b/b.py\n@@ -1 +1 @@\n-nope\n+x\n"
    )
    with pytest.raises(PatchError, match=r"b.py: hunk 1 \(@@ -1\) does not apply"):
        apply_patch_text(str(tmp_path), patch)
    assert (tmp_path / "a.py").read_text() == "one\ntwo\n"  # checked in full before writing
    with pytest.raises(PatchError, match="outside the workspace"):
        apply_patch_text(str(tmp_path), "--- /dev/null\n+++ b/../escape.py\n@@ -0,0 +1 @@\n+x\n")
    with pytest.raises(PatchError, match="not a unified diff"):
        apply_patch_text(str(tmp_path), "just words")


def _row(**changes) -> dict:
    row = {
        "instance_id": "demo-1",
        "repo": "repo",
        "problem_statement": "add is wrong",
        "FAIL_TO_PASS": '["tests/test_a.py::test_add"]',  # a JSON string, as the published dataset has it
        "PASS_TO_PASS": [],
        "test_patch": "--- a/tests/test_a.py\n+++ b/tests/test_a.py\n@@ -1 +1,2 @@\n import m\n+def test_add(): assert m.add(1, 1) == 2\n",
    }
    return {**row, **changes}


def _jsonl(tmp_path: Path, *rows: dict) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_swe_rows_load_with_their_hidden_tests_as_whole_files(tmp_path):
    _write(tmp_path / "repo", {"m.py": "def add(a, b): return a - b\n", "tests/test_a.py": "import m\n"})
    (task,) = load_repo_tasks(_jsonl(tmp_path, _row()))
    assert task["repo"] == str((tmp_path / "repo").resolve()) and task["FAIL_TO_PASS"] == [
        "tests/test_a.py::test_add"
    ]
    assert task["hidden_files"] == {"tests/test_a.py": "import m\ndef test_add(): assert m.add(1, 1) == 2\n"}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"problem_statement": ""}, r"tasks.jsonl:1.problem_statement: must be a non-empty string"),
        ({"repo": "nowhere"}, r"tasks.jsonl:1.repo: 'nowhere' is not a local directory or archive \(set"),
        ({"FAIL_TO_PASS": []}, r"tasks.jsonl:1.FAIL_TO_PASS: a task needs at least one test"),
        ({"PASS_TO_PASS": "[1"}, r"tasks.jsonl:1.PASS_TO_PASS: not a JSON list"),
        ({"test_patch": "--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"}, r"test_patch: does not apply"),
        # test_patch names repository files: none outside it is read or written on the host
        (
            {"test_patch": "--- a/../../x.py\n+++ b/../../x.py\n@@ -1 +1 @@\n-a\n+b\n"},
            r"outside the workspace",
        ),
        ({"test_patch": "--- /dev/null\n+++ /tmp/x.py\n@@ -0,0 +1 @@\n+b\n"}, r"outside the workspace"),
    ],
)
def test_a_bad_row_is_refused_naming_its_line_and_field(tmp_path, change, says):
    _write(tmp_path / "repo", {"m.py": "", "tests/test_a.py": "import m\n"})
    with pytest.raises(EnvironmentError_, match=says):
        load_repo_tasks(_jsonl(tmp_path, _row(**change)))


def test_a_git_repository_is_used_at_its_base_commit(tmp_path):
    repo = tmp_path / "checkouts" / "octo__demo"
    _write(repo, {"m.py": "def add(a, b): return a - b\n", "tests/test_a.py": "import m\n"})
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    base = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    _write(
        repo, {"m.py": "def add(a, b): return a + b  # fixed later\n", "tests/test_a.py": "changed later\n"}
    )
    subprocess.run([*git, "commit", "-qam", "later"], check=True)
    rows = _jsonl(tmp_path, _row(repo="octo/demo", base_commit=base))
    (task,) = load_repo_tasks(rows, repos_root=str(tmp_path / "checkouts"))
    assert task["base_commit"] == base
    assert task["hidden_files"]["tests/test_a.py"].startswith("import m\n")  # test_patch on the base file
    store = LayerStore(tmp_path / "layers")
    layer = store.path(store.base(task["repo"], base))
    assert (layer / "m.py").read_text() == "def add(a, b): return a - b\n" and not (layer / ".git").exists()
    assert oct((layer / "m.py").stat().st_mode & 0o777) == "0o666"  # any sandbox uid may edit it


@pytest.fixture
def confined(tmp_path):
    """Tasks confined as the service confines them, to one data directory (tmp_path/data)."""
    data = tmp_path / "data"
    data.mkdir()
    repo_tasks.confine([data])
    yield data
    repo_tasks.confine(None)


def test_tasks_and_repositories_outside_the_data_directories_answer_as_missing(tmp_path, confined):
    outside = tmp_path / "elsewhere"
    _write(outside, {"m.py": "SECRET = 1\n", "tests/test_a.py": "import m\n"})
    _write(confined / "repo", {"m.py": "", "tests/test_a.py": "import m\n"})
    (confined / "link").symlink_to(outside)
    (confined / "tasks.jsonl").write_text(json.dumps(_row()) + "\n")
    assert load_repo_tasks(str(confined / "tasks.jsonl"))[0]["repo"] == str((confined / "repo").resolve())
    for repo in (str(outside), "link", "../elsewhere"):  # absolute, a symlink out, '..'
        (confined / "bad.jsonl").write_text(json.dumps(_row(repo=repo)) + "\n")
        with pytest.raises(EnvironmentError_, match=r"bad.jsonl:1.repo: .* in the data directories"):
            load_repo_tasks(str(confined / "bad.jsonl"))
    (outside / "tasks.jsonl").write_text(json.dumps(_row(repo=str(confined / "repo"))) + "\n")
    with pytest.raises(EnvironmentError_, match=r"dataset: .* does not exist in the data directories"):
        load_repo_tasks(str(outside / "tasks.jsonl"))
    # A task handed over whole (a Reset session's task_json) names its repository too.
    env = make_environment("repo", None)
    with pytest.raises(EnvironmentError_, match=r"task_json.repo: .* in the data directories"):
        env.validate_task({**_row(repo=str(outside)), "kind": "swe", "FAIL_TO_PASS": ["t"]})
    # The shipped corpus stays readable whatever the data directories are.
    assert load_repo_tasks(str(CORPUS / "harbor"))


def test_harbor_directories_load_and_bad_ones_name_the_missing_file(tmp_path):
    tasks = load_repo_tasks(str(CORPUS / "harbor"))
    assert tasks and all(t["problem_statement"] and t["solution"] and "test.sh" in t["tests"] for t in tasks)
    assert tasks[0]["verifier_timeout_s"] == 120.0 and tasks[0]["repo"].endswith("environment/workspace")
    broken = tmp_path / "task"
    _write(broken, {"task.toml": 'version = "1.0"\n', "environment/Dockerfile": "FROM scratch\n"})
    with pytest.raises(EnvironmentError_, match=r"task/instruction.md: missing"):
        load_repo_tasks(str(broken))


def test_the_shipped_corpus_is_what_its_tool_writes():
    assert make_repo_corpus.main(["--out", str(CORPUS), "--check"]) == 0


def test_the_repo_environment_config_names_bad_fields():
    with pytest.raises(EnvironmentError_, match=r"environment_config.tools"):
        make_environment("repo", {"tools": ["rm_rf"]})
    env = make_environment("repo", {"tools": ["read_file"]})
    assert [t["function"]["name"] for t in env.tool_schemas()] == ["read_file", "submit"]


def test_long_tool_output_keeps_head_and_tail_around_a_marker():
    text = "".join(f"{i:04d}\n" for i in range(2000))
    cut = truncate(text, 500)
    assert len(cut) <= 500 and cut.startswith("0000\n") and cut.endswith("1999\n")
    assert "characters truncated" in cut and truncate("short", 500) == "short"


def test_pytest_summary_lines_give_each_tests_outcome():
    output = "PASSED tests/t.py::a\nFAILED tests/t.py::b - assert 1 == 2\nERROR tests/t.py::c\n1 failed"
    assert pytest_outcomes(output) == {
        "tests/t.py::a": "PASSED",
        "tests/t.py::b": "FAILED",
        "tests/t.py::c": "ERROR",
    }


async def test_create_runs_check_loads_the_dataset_and_holds_no_workspace():
    from looprl.environment.v1 import environment_pb2 as pb
    from services.environment_sandbox.sandbox import SandboxConfig, SandboxPool
    from services.environment_sandbox.servicer import EnvironmentSandboxServicer
    from services.kit.rpc.errors import InvalidArgument

    pool = SandboxPool(SandboxConfig())
    servicer = EnvironmentSandboxServicer(pool, None)
    try:
        config = {"dataset": str(CORPUS / "tasks.jsonl"), "max_turns": 4}
        request = pb.LoadEnvironmentRequest(
            environment="repo", environment_config_json=json.dumps(config), tokenizer="char"
        )
        reply = await servicer.LoadEnvironment(request, None)
        assert json.loads(reply.first_task_json)["instance_id"].startswith("looprl__")
        assert reply.environment.multi_turn and pool.workspaces.stats()["opened"] == 0
        missing = {"dataset": "nowhere/tasks.jsonl", "max_turns": 4}
        request = pb.LoadEnvironmentRequest(
            environment="repo", environment_config_json=json.dumps(missing), tokenizer="char"
        )
        with pytest.raises(
            InvalidArgument, match=r"environment.config.dataset: 'nowhere/tasks.jsonl' does not exist"
        ):
            await servicer.LoadEnvironment(request, None)
    finally:
        await pool.close()
