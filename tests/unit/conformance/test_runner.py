"""How the kit reports what it finds: a broken promise fails its case with what was seen, a missing
prerequisite skips naming it, and a server that is not there fails every case instead of crashing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc

from conformance.case import CaseFailed, Contract, check, run_cases, skip

ROOT = Path(__file__).resolve().parents[3]


def test_outcomes_are_passed_failed_or_skipped_with_the_reason() -> None:
    contract = Contract("demo", "looprl.demo.v1.DemoService", "demo")

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INTERNAL

        def details(self):
            return "boom"

    def refused(session):
        raise Refused()

    contract.add("a.passes", "A", "passes", "OK", "x", "y", lambda s: check(True, "never"))
    contract.add("a.fails", "A", "fails", "OK", "x", "y", lambda s: check(False, "saw 3, expected 4"))
    contract.add("a.skips", "A", "skips", "OK", "x", "y", lambda s: skip("needs a run"))
    contract.add("a.rpc", "A", "rpc error", "OK", "x", "y", refused)
    contract.add("a.bug", "A", "bug", "OK", "x", "y", lambda s: [][1])
    results = {r.case.id: (r.outcome, r.message) for r in run_cases(contract, object(), contract.cases)}
    assert results["demo.a.passes"] == ("passed", "")
    assert results["demo.a.fails"] == ("failed", "saw 3, expected 4")
    assert results["demo.a.skips"] == ("skipped", "needs a run")
    assert results["demo.a.rpc"] == ("failed", "unexpected INTERNAL: boom")
    assert results["demo.a.bug"][0] == "failed" and "IndexError" in results["demo.a.bug"][1]
    assert issubclass(CaseFailed, AssertionError)


def _looprl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "conformance", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_server_that_is_not_there_fails_every_case_without_a_traceback(tmp_path) -> None:
    from services.kit.local.infra import free_port

    result = _looprl("reward", "--address", f"127.0.0.1:{free_port()}", "--insecure", "--timeout", "2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "FAIL  reward.health.serving: unexpected UNAVAILABLE" in result.stdout
    assert "0 passed" in result.stdout


def test_usage_errors_say_what_to_give() -> None:
    missing = _looprl("reward", "--address", "127.0.0.1:1", "--state-dir", "/nonexistent")
    assert missing.returncode == 2 and "--tls-dir" in missing.stderr
    half = _looprl("reward", "--address", "127.0.0.1:1", "--ca", "ca.crt")
    assert half.returncode == 2 and "--ca, --cert and --key go together" in half.stderr
    listed = _looprl("weight-sync", "--list")
    assert listed.returncode == 0
    assert (
        "weight-sync.push.checksum_mismatch" in listed.stdout and "--option receiver_host=" in listed.stdout
    )
