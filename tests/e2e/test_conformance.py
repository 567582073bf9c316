"""The conformance kit against looprl's own services on the shared live stack (mutual TLS, every
service its own process), as a user runs it: `looprl conformance` and the pytest plugin; and a
broken variant of each service fails the case that checks the promise it breaks.

The shared stack serves no run and has no weights: the cases here change nothing a later test sees
(the kit's pushes and commits run on the stack of test_swapped_parts.py, after its run).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import conformance
from tests.support.kit_runs import assert_passes, broken_variant_fails, kit_cli

pytestmark = pytest.mark.slow

READ_ONLY = ("reward", "environment-sandbox", "rollout-packer", "trainer")


@pytest.mark.parametrize("contract", READ_ONLY)
def test_looprl_services_pass_their_kit_on_the_live_stack(stack, contract: str) -> None:
    # No --address: the local stack's service, called with the stack's certificates.
    result = kit_cli(contract, state_dir=stack.state_dir)
    assert_passes(result)
    assert "PASS  " + f"{contract}.auth.identity" in result.stdout  # authorization was checked, not skipped


@pytest.mark.parametrize("contract", ["reward", "environment-sandbox", "trainer"])
def test_a_broken_variant_fails_the_case_that_names_its_broken_promise(stack, contract: str) -> None:
    backend = stack.state.service(contract).address
    expected, failed = broken_variant_fails(contract, backend, stack.state.tls_dir, contract)
    assert expected in failed, f"{contract}: the kit did not catch the mutation; failed: {failed}"
    # The real service passes that same case (the failure is the mutation's, not the stack's).
    assert_passes(kit_cli(contract, "--case", expected, state_dir=stack.state_dir))


def test_the_pytest_plugin_checks_a_service_from_a_users_own_ci(stack, tmp_path) -> None:
    """A user's CI: an empty directory, pytest with the plugin and the service's address."""
    address = stack.state.service("reward").address
    tls = str(stack.state.tls_dir)

    def pytest_run(*args: str) -> subprocess.CompletedProcess:
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "conformance.pytest_plugin",
            "-q",
            "-p",
            "no:cacheprovider",
        ]
        env = {**os.environ, "COLUMNS": "250"}  # the summary lines whole
        return subprocess.run(
            [*command, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )

    passed = pytest_run("--conformance", f"reward={address}", "--conformance-tls-dir", tls)
    cases = len(conformance.contract("reward").cases)
    assert passed.returncode == 0 and f"{cases} passed" in passed.stdout, passed.stdout + passed.stderr

    from tests.support.mutants import Proxy, mutation

    with Proxy(address, mutation("reward"), stack.state.tls_dir, "reward") as broken:
        failed = pytest_run(
            "--conformance", f"reward={broken.address}", "--conformance-tls-dir", tls, "-k", "score"
        )
    assert failed.returncode == 1, failed.stdout
    assert f"conformance::reward.score.finite@{broken.address} - reward.score.finite" in failed.stdout
    assert 'promised by looprl.reward.v1.ScoreResponse.score: "always finite"' in failed.stdout
