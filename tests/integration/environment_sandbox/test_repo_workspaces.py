"""Copy-on-write repository workspaces in real sandboxes: forks of a live workspace diverge and see
neither each other's changes nor the hidden tests; forks of forks and closed parents behave; the
episode's limits hold; the token ids of a tool-calling episode are exactly those the model sampled."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import transformers

from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from services.environment_sandbox.agent_loop import EpisodeRunner, ModelTurn
from services.environment_sandbox.config import LoopConfig, WorkspaceConfig
from services.environment_sandbox.environments import EnvContext
from services.environment_sandbox.environments.repo import SYSTEM_PROMPT, TOOLS, pytest_outcomes
from services.environment_sandbox.environments.repo_tasks import load_repo_tasks
from services.environment_sandbox.model_io import OneAtATime
from services.environment_sandbox.sandbox import SandboxConfig, SandboxPool
from services.environment_sandbox.sandbox.workspaces import WorkspaceError
from services.modeling.tokenizer import TokenizerCache, load_tokenizer
from tests.support.repo_agents import CORPUS, call
from tools.build_hf_model import build

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="workspace sandboxes mount and drop privileges: needs root"),
]
UID_BASE = 730000
TASK = next(
    t for t in load_repo_tasks(str(CORPUS / "tasks.jsonl")) if t["instance_id"] == "looprl__statskit-1"
)
MODULE = "statskit/summary.py"
HIDDEN = "tests/test_summary.py"
FIXED = (
    (CORPUS / "repos" / "statskit" / MODULE)
    .read_text()
    .replace(
        "    return ordered[middle]\n\n\ndef mode",
        "    return (ordered[middle - 1] + ordered[middle]) / 2\n\n\ndef mode",
    )
)


@pytest.fixture(scope="module")
async def pool():
    limits = WorkspaceConfig(warm_per_repository=1, max_warm=2, disk_bytes=8 << 20, cpu_seconds=60, pids=48)
    p = await SandboxPool(SandboxConfig(warm_workers=0, uid_base=UID_BASE, workspace=limits)).start()
    yield p
    await p.close()


async def _sh(workspaces, workspace: str, command: str) -> str:
    return (await workspaces.run(workspace, ["bash", "-c", command]))["output"]


async def _hidden_results(workspaces, workspace: str) -> dict[str, str]:
    """FAIL_TO_PASS outcomes in a scoring fork of `workspace` (the hidden tests laid on top)."""
    scoring = await workspaces.fork(workspace, files=TASK["hidden_files"], timeout_s=60)
    try:
        ids = " ".join(TASK["FAIL_TO_PASS"])
        output = await _sh(workspaces, scoring["id"], f"{TASK['test_command']} {ids}")
        return {t: pytest_outcomes(output).get(t, "MISSING") for t in TASK["FAIL_TO_PASS"]}
    finally:
        await workspaces.close(scoring["id"])


async def test_two_forks_of_a_live_workspace_diverge_and_see_neither_each_other_nor_the_hidden_tests(pool):
    ws = pool.workspaces
    parent = (await ws.open(TASK["repo"]))["id"]
    await _sh(ws, parent, "echo 'shared notes' > NOTES.md")
    one, two = (await ws.fork(parent))["id"], (await ws.fork(parent))["id"]
    try:
        # Different edits: one fixes the bug, the other breaks the module differently.
        await ws.run(
            one,
            ["python", "/opt/looprl/looprl_tools.py", "write_file"],
            json.dumps({"path": MODULE, "content": FIXED}),
        )
        await _sh(
            ws, two, f"printf '\\ndef median(values):\\n    return -1\\n' >> {MODULE}; echo two > ONLY_TWO"
        )
        await _sh(ws, parent, "echo parent > ONLY_PARENT")
        for name, other in ((one, "ONLY_TWO"), (two, "ONLY_PARENT"), (parent, "ONLY_TWO")):
            listing = await _sh(ws, name, "ls; cat NOTES.md")
            assert other not in listing and "shared notes" in listing  # what was there at the fork, no more
        assert await _sh(ws, one, f"grep -c 'middle - 1' {MODULE}") == "1\n"
        assert await _sh(ws, two, f"grep -c 'middle - 1' {MODULE}") == "0\n"
        # The hidden test is nowhere in either fork (or the parent) ...
        for name in (one, two, parent):
            found = await _sh(ws, name, "grep -rl test_median_even . /tmp /tests 2>/dev/null; cat " + HIDDEN)
            assert "test_median_even" not in found
        # ... and the two forks' test results differ.
        assert await _hidden_results(ws, one) == {TASK["FAIL_TO_PASS"][0]: "PASSED"}
        assert await _hidden_results(ws, two) == {TASK["FAIL_TO_PASS"][0]: "FAILED"}
        assert await _hidden_results(ws, parent) == {TASK["FAIL_TO_PASS"][0]: "FAILED"}
    finally:
        for name in (parent, one, two):
            await ws.close(name)


async def test_a_fork_of_a_fork_outlives_its_closed_ancestors(pool):
    ws = pool.workspaces
    parent = (await ws.open(TASK["repo"]))["id"]
    await _sh(ws, parent, "echo 1 > a; rm README.md")
    child = (await ws.fork(parent))["id"]
    await _sh(ws, child, "echo 2 > b")
    grandchild = (await ws.fork(child))["id"]
    await ws.close(parent)
    await ws.close(child)
    try:
        assert await _sh(ws, grandchild, "cat a b; ls README.md 2>&1 | grep -c 'No such'") == "1\n2\n1\n"
        with pytest.raises(WorkspaceError, match="no such live workspace"):
            await ws.run(parent, ["true"])
    finally:
        await ws.close(grandchild)


async def test_changes_to_pytest_configuration_are_undone_before_scoring(pool):
    ws = pool.workspaces
    parent = (await ws.open(TASK["repo"]))["id"]
    hook = (
        "import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n"
    )
    try:
        await ws.run(
            parent,
            ["python", "/opt/looprl/looprl_tools.py", "write_file"],
            json.dumps({"path": "tests/conftest.py", "content": hook}),
        )
        # Forked: the conftest now sits in a frozen lower layer of the workspace, undone there too.
        middle = (await ws.fork(parent))["id"]
        await ws.close(parent)
        parent = middle
        assert "passed" in await _sh(ws, parent, "python -m pytest -q -p no:cacheprovider 2>&1 | tail -1")
        scoring = await ws.fork(parent, files=TASK["hidden_files"], revert=("conftest.py",), timeout_s=60)
        try:
            output = await _sh(
                ws, scoring["id"], f"ls tests; {TASK['test_command']} {TASK['FAIL_TO_PASS'][0]}"
            )
            assert "conftest.py" not in output and "FAILED" in output
        finally:
            await ws.close(scoring["id"])
    finally:
        await ws.close(parent)


async def test_a_command_stops_at_the_episode_wall_clock_and_none_runs_after_it(pool):
    ws = pool.workspaces
    short = (await ws.open(TASK["repo"], episode_timeout_s=1.0))["id"]
    try:
        result = await ws.run(short, ["sleep", "5"])
        assert result["timed_out"] and result["wall_seconds"] < 3
        with pytest.raises(WorkspaceError, match="wall clock is spent"):
            await ws.run(short, ["true"])
    finally:
        await ws.close(short)


# -- token in, token out --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "tiny-bpe"
    build(out, seed=0)
    return out


class CharByCharPolicy:
    """Stands where the inference-router is. Each reply is sampled one character per token (how a
    model may well spell it), not as the tokenizer would encode the text, so any re-tokenization of
    the rendered conversation between turns would change the ids."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer, self.replies = tokenizer, replies
        self.prompts: list[list[int]] = []
        self.sampled: list[list[int]] = []

    async def __call__(self, prompt_ids, sampling, session_id, min_weight_version):
        self.prompts.append(list(prompt_ids))
        reply = self.replies[len(self.sampled)]
        ids = [i for ch in reply for i in self.tokenizer.encode(ch)] + [self.tokenizer.eos_token_id]
        self.sampled.append(ids)
        return ModelTurn(ids, [-1.0] * len(ids), "stop", 7)


async def test_token_ids_in_and_out_of_a_tool_calling_episode_are_exactly_the_sampled_ones(pool, hf_dir):
    tokenizer = load_tokenizer(hf_dir)
    replies = [
        call("read_file", path=MODULE, start_line=1, end_line=5),
        call("run_shell", command="ls tests") + call("search", pattern="def median"),
        call("write_file", path=MODULE, content=FIXED),
        call("submit"),
    ]
    policy = CharByCharPolicy(tokenizer, replies)
    runner = EpisodeRunner(
        OneAtATime(policy),
        None,
        TokenizerCache("char"),
        EnvContext(workspaces=pool.workspaces),
        LoopConfig(max_episode_tokens=16384),
    )
    task = events_pb2.EpisodeTask(
        run_id="r",
        task_id="t",
        group_id="g",
        environment="repo",
        task_json=json.dumps(TASK),
        environment_config_json=json.dumps({"max_turns": 6}),
        sampling=common_pb2.SamplingParams(max_tokens=512),
        tokenizer=str(hf_dir),
    )
    rollout = await runner.run(task)
    assert rollout.reward == 1.0 and rollout.finish_reason == "submit"
    model_turns = [list(t.token_ids) for t in rollout.turns if t.role == common_pb2.ROLE_ASSISTANT]
    # Out: every model turn's ids are the sampled ids, turn by turn (not a re-encoding of their text).
    assert model_turns == policy.sampled
    assert policy.sampled[0][:-1] != tokenizer.encode(replies[0])  # the test would notice one
    # In: each turn's prompt is every id of the episode so far, extended, never re-rendered.
    for n, prompt in enumerate(policy.prompts):
        turns_so_far = [i for t in rollout.turns[: 2 * n + 1] for i in t.token_ids]
        assert prompt == turns_so_far
    # The tools were rendered by the run's chat template, as transformers renders them ...
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": TASK["problem_statement"]},
    ]
    expected = hf.apply_chat_template(
        messages, tools=list(TOOLS.values()), add_generation_prompt=True, tokenize=True
    )
    assert policy.prompts[0] == list(expected["input_ids"])
    # ... and the results came back as tool responses in the template's convention, masked out.
    results = [t for t in rollout.turns if t.role == common_pb2.ROLE_ENVIRONMENT]
    assert all("<tool_response>" in t.text and not t.trainable and not t.logprobs for t in results)
    assert "def median" in results[1].text and results[1].text.count("<tool_response>") == 2
