"""Conformance cases: what one case is, how a contract's cases are declared, and how they run.

A case checks one behaviour a contract promises, in the words of the .proto comment that promises
it: `proto` names the element (service, RPC, message or field, fully qualified) and `quote` the
words of its comment the case checks (tools/gen_conformance_docs.py fails when they are not there,
and renders every case into docs/conformance.md). Cases of a contract run in the order they are
declared against one `Session`, whose `facts` carry what earlier cases established (a committed
weight version, a planned step); a case whose prerequisite is missing is skipped naming it, so the
first broken promise is the one reported as failed.
"""

from __future__ import annotations

import fnmatch
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc


class CaseFailed(AssertionError):
    """The service broke the promise the case checks; the message says how."""


class CaseSkipped(Exception):
    """The case cannot run here (a prerequisite, an option or a capability is missing)."""


@dataclass(frozen=True)
class Case:
    id: str
    """`<contract>.<rpc or topic>.<behaviour>`, unique; what a failure is reported as."""
    contract: str
    rpc: str
    """The RPC the case calls (`Health`, `Reflection` for the standard services)."""
    behaviour: str
    """What the service must do, one sentence."""
    status: str
    """The status code the behaviour answers with (`OK`, `INVALID_ARGUMENT`, ...)."""
    proto: str
    """Fully qualified name of the .proto element whose comment states the behaviour."""
    quote: str
    """Words of that comment the case checks."""
    run: Callable[[Any], None]


@dataclass
class Result:
    case: Case
    outcome: str  # "passed", "failed", "skipped"
    message: str = ""
    seconds: float = 0.0


@dataclass
class Contract:
    """The cases of one contract, in order, and what a target of it needs."""

    name: str
    service: str
    """Full protobuf name of the service (`looprl.reward.v1.RewardService`)."""
    summary: str
    options: dict[str, str] = field(default_factory=dict)
    """Options this contract's cases read (`--option name=value`), with what each means."""
    cases: list[Case] = field(default_factory=list)
    setup: Callable[[Any], None] | None = None
    teardown: Callable[[Any], None] | None = None

    def case(
        self, id: str, rpc: str, behaviour: str, status: str, proto: str, quote: str
    ) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
        """Decorator declaring a case of this contract (in declaration order)."""

        def add(run: Callable[[Any], None]) -> Callable[[Any], None]:
            self.add(id, rpc, behaviour, status, proto, quote, run)
            return run

        return add

    def add(
        self,
        id: str,
        rpc: str,
        behaviour: str,
        status: str,
        proto: str,
        quote: str,
        run: Callable[[Any], None],
    ) -> None:
        full = f"{self.name}.{id}"
        if any(c.id == full for c in self.cases):
            raise ValueError(f"case {full} declared twice")
        self.cases.append(Case(full, self.name, rpc, behaviour, status, proto, quote, run))

    def select(self, patterns: Iterable[str] = ()) -> list[Case]:
        """The cases whose id matches any of the glob patterns (all without patterns)."""
        patterns = list(patterns)
        if not patterns:
            return list(self.cases)
        return [c for c in self.cases if any(fnmatch.fnmatchcase(c.id, p) for p in patterns)]


def run_cases(
    contract: Contract, session: Any, cases: list[Case], report: Callable[[Result], None] | None = None
) -> list[Result]:
    """Run `cases` in order against `session`; never raises for what a case finds."""
    results = []
    try:
        if contract.setup is not None:
            contract.setup(session)
        for case in cases:
            result = run_one(case, session)
            results.append(result)
            if report is not None:
                report(result)
    finally:
        if contract.teardown is not None:
            contract.teardown(session)
    return results


def run_one(case: Case, session: Any) -> Result:
    started = time.monotonic()
    try:
        case.run(session)
    except CaseSkipped as exc:
        return Result(case, "skipped", str(exc), time.monotonic() - started)
    except CaseFailed as exc:
        return Result(case, "failed", str(exc), time.monotonic() - started)
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") else "?"
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return Result(case, "failed", f"unexpected {code}: {details}", time.monotonic() - started)
    except Exception as exc:  # a bug in what the service answered, as seen by the kit
        where = traceback.extract_tb(exc.__traceback__)[-1]
        message = f"{type(exc).__name__}: {exc} (at {where.name}:{where.lineno})"
        return Result(case, "failed", message, time.monotonic() - started)
    return Result(case, "passed", "", time.monotonic() - started)


def check(condition: object, message: str) -> None:
    """Fail the running case with `message` unless condition holds."""
    if not condition:
        raise CaseFailed(message)


def skip(reason: str) -> None:
    raise CaseSkipped(reason)
