"""Running the conformance kit from tests: as a user does (`looprl conformance`, a subprocess) and
in-process (for a broken variant, whose failed cases the test names)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import conformance
from conformance.target import Credentials, Target
from tests.support.mutants import Proxy, mutation

ROOT = Path(__file__).resolve().parents[2]


def kit_cli(
    contract: str, *args: str, state_dir: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`looprl [--state-dir S] conformance CONTRACT ARGS...`."""
    state = ["--state-dir", str(state_dir)] if state_dir is not None else []
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *state, "conformance", contract, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_passes(result: subprocess.CompletedProcess) -> None:
    """The kit ran every case and none failed (the report says which did, and why)."""
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAIL", "      promised"))]
    assert result.returncode == 0 and " 0 failed" in result.stdout, (
        "\n".join(failed) or result.stdout + result.stderr
    )


def failed_cases(
    contract: str, address: str, tls_dir: Path | None, options: dict[str, str] | None = None
) -> dict[str, str]:
    """Case id -> what was seen, for every case of `contract` that fails against `address`."""
    credentials = Credentials.from_dir(tls_dir) if tls_dir is not None else None
    results = conformance.run(contract, Target(address, credentials, options=options or {}))
    return {r.case.id: r.message for r in results if r.outcome == "failed"}


def broken_variant_fails(
    contract: str,
    backend: str,
    tls_dir: Path | None,
    server_identity: str,
    options: dict[str, str] | None = None,
) -> tuple[str, dict[str, str]]:
    """Run `contract`'s kit against the broken variant of the service at `backend` (tests/support/
    mutants.py); returns the case the mutation must fail and every case that failed."""
    broken = mutation(contract)
    with Proxy(backend, broken, tls_dir, server_identity) as proxy:
        return broken.breaks, failed_cases(contract, proxy.address, tls_dir, options)
