"""The parts under examples/ written outside looprl, as a test starts them: the Node.js reward service
(its pinned dependencies installed with `npm ci` from the registry, as CI would) and the transformers
engine, each as its own process printing "ADDRESS host:port" once it serves."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE_REWARD = ROOT / "examples" / "node_reward"
HF_ENGINE = ROOT / "examples" / "hf_engine" / "engine.py"


def _unavailable(reason: str) -> None:
    """Offline, a missing toolchain skips; under CI it fails (nothing may quietly not run there)."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(reason)
    pytest.skip(reason)


def install_node_reward() -> str:
    """`npm ci` in examples/node_reward (the versions of its package-lock.json); returns node's path."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        _unavailable("node and npm are needed for examples/node_reward")
    result = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
        cwd=NODE_REWARD,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0:
        _unavailable(f"npm ci in {NODE_REWARD} failed:\n{result.stdout}{result.stderr}")
    return node


@contextmanager
def serving(command: list[str], cwd: Path, log: Path, timeout: float = 120.0) -> Iterator[str]:
    """Start `command` (its output to `log`), yield the address it prints, stop it after."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            text = log.read_text(errors="replace")
            address = next((line.split()[1] for line in text.splitlines() if line.startswith("ADDRESS ")), "")
            if address:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[:2]} did not start:\n{text[-3000:]}")
            time.sleep(0.1)
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def node_reward(node: str, tls_dir: Path, log: Path, port: int = 0):
    return serving([node, "server.js", "--port", str(port), "--tls-dir", str(tls_dir)], NODE_REWARD, log)


def hf_engine(tls_dir: Path, log: Path, port: int = 0):
    command = [
        sys.executable,
        str(HF_ENGINE),
        "--port",
        str(port),
        "--tls-dir",
        str(tls_dir),
        "--identity",
        "hf-engine",
    ]
    return serving(command, ROOT, log)
