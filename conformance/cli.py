"""`looprl conformance CONTRACT --address HOST:PORT`: run a contract's cases against a server and say,
case by case, what it kept and what it broke (the failed case's id, the proto comment it checks and
what was seen). Exit status 0 when nothing failed, 1 when a case failed, 2 for a usage error.

Without --address (and --tls-dir) the local stack's service of that name is checked with the
stack's certificates (`looprl up`'s state directory).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from conformance import NAMES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("contract", choices=NAMES, help="the contract the server implements")
    p.add_argument("--address", help="HOST:PORT of the server (default: the local stack's service)")
    p.add_argument(
        "--tls-dir", help="ca.crt and <identity>.crt/.key per caller identity (`looprl certs` layout)"
    )
    p.add_argument("--ca", help="CA certificate (PEM) of the server; with --cert and --key, one identity")
    p.add_argument("--cert", help="client certificate (PEM) the kit calls with")
    p.add_argument("--key", help="its private key (PEM)")
    p.add_argument(
        "--server-name", default="", help="the name the server's certificate carries, when not its address"
    )
    p.add_argument("--insecure", action="store_true", help="plaintext (a server run without TLS)")
    p.add_argument(
        "--option", action="append", default=[], metavar="NAME=VALUE", help="a contract option (see --list)"
    )
    p.add_argument(
        "--case", action="append", default=[], metavar="GLOB", help="run only the cases matching (repeatable)"
    )
    p.add_argument("--timeout", type=float, default=20.0, help="seconds per RPC (default 20)")
    p.add_argument("--list", action="store_true", help="list the contract's cases and options, run nothing")
    p.add_argument("--json", action="store_true", help="one JSON line per case instead of text")


# The local stack's service of a contract: name -> (address, certificates directory); ("", "") for none.
LocalStack = Callable[[str], tuple[str, str]]


def target_from_args(args: argparse.Namespace, local: LocalStack | None = None):
    """The Target the arguments name; ValueError with a sentence when they do not add up."""
    from conformance.target import Credentials, Target

    options = {}
    for item in args.option:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--option {item!r}: expected NAME=VALUE")
        options[name] = value
    address, tls_dir = args.address, args.tls_dir
    if not address and local is not None:
        address, stack_tls = local(args.contract)
        tls_dir = tls_dir or stack_tls
    if not address:
        raise ValueError("--address HOST:PORT is required (no local stack serves this contract)")
    if args.insecure:
        credentials = None
    elif args.ca or args.cert or args.key:
        if not (args.ca and args.cert and args.key):
            raise ValueError("--ca, --cert and --key go together")
        credentials = Credentials.from_files(args.ca, args.cert, args.key)
    elif tls_dir:
        credentials = Credentials.from_dir(tls_dir)
    else:
        raise ValueError("give --tls-dir, or --ca/--cert/--key, or --insecure for a plaintext server")
    return Target(address, credentials, args.server_name, args.timeout, options)


def list_cases(name: str, out=sys.stdout) -> None:
    import conformance

    chosen = conformance.contract(name)
    print(f"{name}: {chosen.summary} ({chosen.service})", file=out)
    for option, meaning in chosen.options.items():
        print(f"  --option {option}=...  {meaning}", file=out)
    for case in chosen.cases:
        print(f"  {case.id:<48} {case.rpc:<20} {case.status:<20} {case.behaviour}", file=out)


def run(args: argparse.Namespace, local: LocalStack | None = None) -> int:
    import conformance

    if args.list:
        list_cases(args.contract)
        return 0
    try:
        target = target_from_args(args, local)
    except ValueError as exc:
        print(f"looprl conformance: {exc}", file=sys.stderr)
        return 2
    cases = conformance.contract(args.contract).select(args.case)
    if not cases:
        print(f"looprl conformance: no case of {args.contract} matches {args.case}", file=sys.stderr)
        return 2

    def report(result) -> None:
        case = result.case
        if args.json:
            print(
                json.dumps(
                    {
                        "case": case.id,
                        "outcome": result.outcome,
                        "message": result.message,
                        "rpc": case.rpc,
                        "status": case.status,
                        "proto": case.proto,
                        "seconds": round(result.seconds, 3),
                    }
                ),
                flush=True,
            )
            return
        mark = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[result.outcome]
        line = f"{mark}  {case.id}"
        if result.message:
            line += f": {result.message}"
        if result.outcome == "failed":
            line += f'\n      promised by {case.proto}: "{case.quote}"'
        print(line, flush=True)

    results = conformance.run(args.contract, target, tuple(args.case), report)
    counts = {o: sum(r.outcome == o for r in results) for o in ("passed", "failed", "skipped")}
    if not args.json:
        print(
            f"{args.contract} at {target.address}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
        )
    return 1 if counts["failed"] else 0
