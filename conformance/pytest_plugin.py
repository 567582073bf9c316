"""The conformance kit as a pytest plugin, for a service's own CI:

    pytest -p conformance.pytest_plugin --conformance reward=127.0.0.1:7000 --conformance-tls-dir certs/

adds one test per case of each named contract (`conformance::reward.score.finite`, ...), run in
the contract's order against that address; a broken promise fails its test with what was seen and
the proto comment it checks. `-k` selects cases as usual (a case whose prerequisite was deselected
is skipped naming it).
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance import NAMES
from conformance.case import Case, run_one


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("looprl conformance")
    group.addoption(
        "--conformance",
        action="append",
        default=[],
        metavar="CONTRACT=HOST:PORT",
        help=f"check the server at HOST:PORT against CONTRACT ({', '.join(NAMES)}); repeatable",
    )
    group.addoption("--conformance-tls-dir", default="", help="ca.crt and <identity>.crt/.key per caller")
    group.addoption("--conformance-ca", default="", help="CA certificate (with --conformance-cert/-key)")
    group.addoption("--conformance-cert", default="", help="client certificate")
    group.addoption("--conformance-key", default="", help="its private key")
    group.addoption("--conformance-server-name", default="", help="name the server certificate carries")
    group.addoption("--conformance-insecure", action="store_true", help="plaintext servers")
    group.addoption(
        "--conformance-option", action="append", default=[], metavar="NAME=VALUE", help="a contract option"
    )
    group.addoption("--conformance-timeout", type=float, default=20.0, help="seconds per RPC")


class _Args:
    """The plugin's options in the shape conformance.cli.target_from_args reads."""

    def __init__(self, config: pytest.Config, contract: str, address: str) -> None:
        self.contract, self.address = contract, address
        self.tls_dir = config.getoption("conformance_tls_dir")
        self.ca = config.getoption("conformance_ca")
        self.cert = config.getoption("conformance_cert")
        self.key = config.getoption("conformance_key")
        self.server_name = config.getoption("conformance_server_name")
        self.insecure = config.getoption("conformance_insecure")
        self.option = config.getoption("conformance_option")
        self.timeout = config.getoption("conformance_timeout")


class ContractRun:
    """One contract against one server: its session, opened at the first case, closed at the end."""

    def __init__(self, config: pytest.Config, name: str, address: str) -> None:
        import conformance

        self.config, self.name, self.address = config, name, address
        self.contract = conformance.contract(name)
        self.session: Any = None

    def open(self) -> Any:
        if self.session is None:
            from conformance.cli import target_from_args
            from conformance.target import Session

            try:
                target = target_from_args(_Args(self.config, self.name, self.address))
            except ValueError as exc:
                raise pytest.UsageError(f"--conformance {self.name}={self.address}: {exc}") from None
            self.session = Session(target, self.contract.service)
            if self.contract.setup is not None:
                self.contract.setup(self.session)
        return self.session

    def close(self) -> None:
        if self.session is None:
            return
        try:
            if self.contract.teardown is not None:
                self.contract.teardown(self.session)
        finally:
            self.session.close()
            self.session = None


class ConformanceItem(pytest.Item):
    def __init__(self, *, run: ContractRun, case: Case, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.contract_run = run
        self.case = case

    def runtest(self) -> None:
        result = run_one(self.case, self.contract_run.open())
        if result.outcome == "skipped":
            pytest.skip(result.message)
        if result.outcome == "failed":
            raise CaseFailure(result.message)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, CaseFailure):
            return (
                f"{self.case.id} at {self.contract_run.address}: {excinfo.value}\n"
                f"  {self.case.rpc} must: {self.case.behaviour} ({self.case.status})\n"
                f'  promised by {self.case.proto}: "{self.case.quote}"'
            )
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[str, int, str]:
        return "conformance", 0, f"{self.case.id} at {self.contract_run.address}"


class CaseFailure(AssertionError):
    pass


class ConformanceCollector(pytest.Collector):
    def collect(self) -> list[pytest.Item]:
        return []


_RUNS = pytest.StashKey[list[ContractRun]]()


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect, which then apply to the cases too
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    targets = config.getoption("conformance")
    if not targets:
        return
    runs = config.stash.setdefault(_RUNS, [])
    parent = ConformanceCollector.from_parent(session, name="conformance")
    for spec in targets:
        name, sep, address = spec.partition("=")
        if not sep or name not in NAMES or not address:
            raise pytest.UsageError(
                f"--conformance {spec!r}: expected CONTRACT=HOST:PORT, CONTRACT one of {', '.join(NAMES)}"
            )
        run = ContractRun(config, name, address)
        runs.append(run)
        items.extend(
            ConformanceItem.from_parent(parent, name=f"{case.id}@{address}", run=run, case=case)
            for case in run.contract.cases
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    for run in session.config.stash.get(_RUNS, []):
        run.close()
