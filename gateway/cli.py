"""The `looprl` command line: local stack (up/down/status) and runs (run/runs/watch/stop/eval).

Argument parsing happens before any heavy import, so `looprl --help` is instant.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from conformance.cli import add_arguments as conformance_arguments


def _state_dir(args: argparse.Namespace) -> Path:
    return Path(args.state_dir or os.environ.get("LOOPRL_STATE_DIR", ".looprl"))


def _gateway(args: argparse.Namespace):
    """(stub, metadata) for the gateway of the local stack, or of --gateway/--token."""
    import grpc

    from gateway.stack import StackState
    from looprl.gateway.v1 import gateway_pb2_grpc

    address, token = args.gateway, args.token or os.environ.get("LOOPRL_TOKEN", "")
    if not address:
        state = StackState.load(_state_dir(args).resolve())
        if state is None:
            sys.exit("no local stack is up (run `looprl up`) and no --gateway given")
        address, token = state.service("gateway").address, token or state.gateway_token
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
    return gateway_pb2_grpc.GatewayServiceStub(channel), (("authorization", f"Bearer {token}"),)


def _ports(args: argparse.Namespace):
    from gateway.stack import StackPorts

    return StackPorts(nats=args.nats_port, ray=args.ray_port, base=args.base_port, http=args.http_port)


def cmd_up(args: argparse.Namespace) -> int:
    from gateway import external
    from gateway.stack import status_rows, up

    try:
        use = external.parse_all(args.use)
        router_env = external.router_env(use, args.recipe)
    except ValueError as exc:
        print(f"looprl up: {exc}", file=sys.stderr)
        return 2
    state = up(
        _state_dir(args),
        _ports(args),
        {**(router_env or _recipe_env(args.recipe)), **_plugin_env(args.plugin_dir, args.data_dir)},
        keep_state=args.keep_state,
        host=args.host,
        ray_resources=json.loads(args.ray_resources) if args.ray_resources else None,
        cert_hosts=tuple(args.cert_host),
        use=tuple(use),
        engine_recipe=str(Path(args.recipe).resolve()) if router_env else "",
    )
    _print_rows(status_rows(state))
    print(f"gateway token: {state.gateway_token}  (HTTP on {state.host}:{state.http_port})")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from gateway.stack import down

    down(_state_dir(args))
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    from gateway.stack import INFRASTRUCTURE, StackState, restart

    state = StackState.load(_state_dir(args).resolve())
    if state is None:
        print("no local stack is up (run `looprl up`)", file=sys.stderr)
        return 1
    names = [s.name for s in state.services] + list(INFRASTRUCTURE)
    outside = {p.role: p.address for p in state.external_parts}
    if args.service in outside:
        print(
            f"{args.service} is not looprl's here (--use, at {outside[args.service]}): restart it where it runs",
            file=sys.stderr,
        )
        return 2
    if args.service not in names:
        print(f"unknown service {args.service!r}; the stack runs: {', '.join(names)}", file=sys.stderr)
        return 2
    svc = restart(_state_dir(args), args.service, kill=args.kill)
    print(f"{svc.name} SERVING again at {svc.address} (pid {svc.pid})")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from gateway.stack import StackState, status_rows

    state = StackState.load(_state_dir(args).resolve())
    if state is None:
        print("nothing is up")
        return 1
    if args.listeners:
        return _print_listeners(state)
    rows = status_rows(state)
    _print_rows(rows)
    versions = _weight_versions(state)
    if versions:
        print("weight versions: " + ", ".join(f"{k}=v{v}" for k, v in versions.items()))
    return 0 if all(r["health"] in ("SERVING", "UP") for r in rows) else 1


def _print_listeners(state) -> int:
    """Every port of the stack, its interface and its guard (docs/listeners.md)."""
    from gateway.listeners import listener_rows

    rows = listener_rows(state)
    print(f"{'PORT':<7}{'INTERFACE':<16}{'PART':<21}{'PROCESS':<26}{'SERVES':<58}GUARD")
    for r in rows:
        print(
            f"{r['port']:<7}{r['interface']:<16}{r['part']:<21}{r['process']:<26}{r['what']:<58}{r['guard']}"
        )
    return 0 if all(r["guard"] != "unknown" for r in rows) else 1


def _weight_versions(state) -> dict[str, int]:
    import grpc

    from looprl.weightsync.v1 import weightsync_pb2, weightsync_pb2_grpc

    try:
        with state.channel("weight-sync") as channel:
            reply = weightsync_pb2_grpc.WeightSyncServiceStub(channel).GetVersion(
                weightsync_pb2.GetVersionRequest(), timeout=2
            )
    except (grpc.RpcError, StopIteration):
        return {}
    return {"latest": reply.latest_version, **{t.deployment: t.version for t in reply.targets}}


def _print_rows(rows: list[dict[str, str]]) -> None:
    width = max(22, *(len(r["name"]) + 2 for r in rows))
    print(f"{'SERVICE':<{width}}{'HEALTH':<24}{'ADDRESS':<24}PID")
    for r in rows:
        print(f"{r['name']:<{width}}{r['health']:<24}{r['address']:<24}{r['pid']}")


def _recipe_env(recipe: str | None) -> dict[str, str]:
    """Services configured from the recipe at start-up: the router serves its deployments to the
    stack's one run instead of starting each run's own."""
    if not recipe:
        return {}
    return {"LOOPRL_INFERENCE_ROUTER_RECIPE": str(Path(recipe).resolve())}


def _plugin_env(dirs: Sequence[str], data_dirs: Sequence[str] = ()) -> dict[str, str]:
    """The plugin directories the environment-sandbox and the reward service load user code from, and
    the data directories recipes' datasets may be read from."""
    env = {}
    for flag, variable, given in (
        ("--plugin-dir", "LOOPRL_PLUGIN_DIRS", dirs),
        ("--data-dir", "LOOPRL_DATA_DIRS", data_dirs),
    ):
        missing = [d for d in given if not Path(d).is_dir()]
        if missing:
            sys.exit(f"looprl: {flag} {missing[0]!r} is not a directory")
        if given:
            env[variable] = os.pathsep.join(str(Path(d).resolve()) for d in given)
    return env


def cmd_certs(args: argparse.Namespace) -> int:
    """A development CA and one certificate per service (for docker compose or a Kubernetes Secret)."""
    from services.kit.bus import nats_auth
    from services.kit.rpc import tls

    if args.identity:
        # A part written outside looprl gets its own certificate from the same CA (reused).
        out = tls.generate_dev_pki(Path(args.out), identities=args.identity, hosts=args.host)
        print(f"certificates for {', '.join(args.identity)} in {out} (CA {out / 'ca.crt'})")
        return 0
    out = tls.generate_dev_pki(Path(args.out), hosts=args.host)
    print(f"CA and certificates for {', '.join(tls.IDENTITIES)} in {out}")
    users = nats_auth.write_credentials(out, [i for i in tls.IDENTITIES if i != tls.OPERATOR])
    print(f"NATS users {', '.join(users)}: nats-server.conf and nats-<user>.creds in {out}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import grpc

    from gateway.run_logs import MissingDependency, check_available
    from gateway.stack import StackState, down, up
    from looprl.gateway.v1 import gateway_pb2
    from services.kit.config.limits import RecipeLimits
    from services.kit.config.recipe import RecipeError, load_recipe

    try:
        # The widest limits here: the gateway holds its cluster's, and says which one a recipe exceeds.
        recipe = load_recipe(args.recipe, limits=RecipeLimits.ceilings())
        check_available(recipe.logging.logger)  # before the run exists, not after it trained
    except (RecipeError, MissingDependency) as exc:
        print(f"invalid recipe {args.recipe}: {exc}", file=sys.stderr)
        return 2
    started_here = False
    existing = StackState.load(_state_dir(args).resolve())
    if args.local and (existing is None or not existing.running()):
        print("bringing the local stack up ...")
        up(
            _state_dir(args), _ports(args), _plugin_env(args.plugin_dir, args.data_dir)
        )  # the run brings its own deployments
        started_here = True
    try:
        stub, metadata = _gateway(args)
        try:
            reply = stub.CreateRun(
                gateway_pb2.CreateRunRequest(recipe_toml=Path(args.recipe).read_text()), metadata=metadata
            )
        except grpc.RpcError as exc:
            print(f"the gateway refused {args.recipe}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2
        print(f"run {reply.run.run_id} created")
        return _follow(stub, metadata, reply.run.run_id, Path(args.report_dir))
    finally:
        if started_here and not args.keep_up:
            print("bringing the local stack down ...")
            down(_state_dir(args))


def _follow(stub, metadata, run_id: str, report_root: Path) -> int:
    from gateway.progress import STATE_NAMES, progress_line, reward_gain
    from gateway.report import GRID_IMAGE, write_report
    from gateway.run_logs import RunLogs, describe

    final, logs = None, None
    started = time.monotonic()
    for update in stub.WatchRun(_watch_request(run_id), metadata=metadata):
        final = update.run
        if logs is None:  # the run's recipe says where it logs
            logs = RunLogs(report_root / run_id, final)
        if "console" in logs.cfg.logger:
            print(f"{time.monotonic() - started:6.0f}s {progress_line(final)}", flush=True)
        logs.update(final)
    if final is None or logs is None:
        return 1
    logs.close(final)
    summary = write_report(final, report_root / run_id)
    first, last = reward_gain(final)
    print(f"reward: first steps {first:.3f} -> last steps {last:.3f} ({last - first:+.3f})")
    print(f"report: {summary.parent / GRID_IMAGE} and {summary}")
    if logs.sinks:
        print(f"logs: {describe(logs)}")
    return 0 if STATE_NAMES.get(final.state) == "completed" else 1


def _watch_request(run_id: str):
    from looprl.gateway.v1 import gateway_pb2

    return gateway_pb2.WatchRunRequest(run_id=run_id)


def hf_export_dir(state_dir: Path, run_id: str, step: int) -> Path:
    """Where the local stack's trainer writes a run's Hugging Face export of a step (each step the
    run evaluates, and its last)."""
    return state_dir / "trainer" / run_id / "hf" / f"step_{step:08d}"


def _exported_steps(hf_root: Path) -> list[int]:
    names = (p.name.removeprefix("step_") for p in hf_root.glob("step_*"))
    return sorted(int(n) for n in names if n.isdigit())


def _step_export(args: argparse.Namespace, source, step: int) -> Path | None:
    """The Hugging Face directory holding the run's weights of `step` as a plain model (a LoRA run's
    merged export), waiting for one still to come; None after saying why there is none."""
    model_dir = Path(args.model_dir) if args.model_dir else hf_export_dir(_state_dir(args), args.run_id, step)
    deadline = time.monotonic() + args.wait

    def exported() -> bool:
        return (model_dir / "config.json").is_file() or (model_dir / "adapter_config.json").is_file()

    # A step the run has not trained past may still be exported (the last one as the run ends); an
    # earlier one was exported before the next step trained, or has been pruned since.
    while not exported() and step >= source.weight_version and time.monotonic() < deadline:
        time.sleep(0.5)
    if not exported():
        there = ", ".join(map(str, _exported_steps(model_dir.parent))) or "none"
        print(
            f"looprl eval: no Hugging Face export of run {args.run_id} at step {step} in {model_dir} (the "
            "trainer exports each step a run evaluates and its last, keeping the newest "
            f"keep_eval_exports of them; exported there: {there}; name another with --model-dir)",
            file=sys.stderr,
        )
        return None
    if (model_dir / "adapter_config.json").is_file():
        # A LoRA run's export is its adapter; what evaluates as the run's policy is the merged model.
        if not (model_dir / "merged" / "config.json").is_file():
            print(
                f"looprl eval: run {args.run_id} trains a LoRA adapter: its export of step {step} ({model_dir}) "
                "is the adapter; evaluating it needs the merged model (model.lora.merge_on_export = true "
                "writes it to merged/, or name one with --model-dir)",
                file=sys.stderr,
            )
            return None
        model_dir = model_dir / "merged"
    return model_dir


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a run's weights of one step on its held-out split, as its evaluations during the run
    did: a run that trains nothing (eval.checkpoint_step) from the step's Hugging Face export, or
    for step 0 from the run's own initial model."""
    import grpc

    from looprl.gateway.v1 import gateway_pb2
    from services.kit.config.limits import RecipeLimits
    from services.kit.config.recipe import Recipe, parse_recipe, recipe_toml

    stub, metadata = _gateway(args)
    source = stub.GetRun(gateway_pb2.GetRunRequest(run_id=args.run_id), metadata=metadata).run
    recipe = parse_recipe(source.recipe_toml, limits=RecipeLimits.ceilings())
    step = source.weight_version if args.step is None else args.step
    data = recipe.model_dump()
    if step == 0 and not args.model_dir:
        # The run's own model section rebuilds its initial weights (model.path, or the preset
        # initialised from run.seed; a LoRA adapter starts as the identity): nothing to export.
        weights = "its initial model"
    else:
        model_dir = _step_export(args, source, step)
        if model_dir is None:
            return 2
        data["model"]["path"] = weights = str(model_dir.resolve())
    if recipe.model.lora is not None:
        data["model"]["lora"] = None
        for d in data["deployments"]:
            d.update(shared=False, max_loras=0, model_path="")  # its replicas serve a plain model
    data["run"]["name"] = f"{recipe.run.name}-eval{step}"
    data["eval"].update(checkpoint_step=step, every=0)
    if data["eval"]["samples"] == 0 and not data["eval"]["greedy"]:
        data["eval"]["greedy"] = True
    text = recipe_toml(Recipe.model_validate(data, context={"limits": RecipeLimits.ceilings()}))
    try:
        reply = stub.CreateRun(gateway_pb2.CreateRunRequest(recipe_toml=text), metadata=metadata)
    except grpc.RpcError as exc:
        print(f"the gateway refused the evaluation: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    print(f"run {reply.run.run_id} evaluates {args.run_id} at step {step} ({weights})")
    status = _follow(stub, metadata, reply.run.run_id, Path(args.report_dir))
    final = stub.GetRun(gateway_pb2.GetRunRequest(run_id=reply.run.run_id), metadata=metadata).run
    recorded = {e.step: e for e in source.evaluations}
    for e in final.evaluations:
        line = f"evaluation of {args.run_id} at step {e.step}: pass@1 {e.pass_at_1:.4f}"
        line += f", pass@{e.k} {e.pass_at_k:.4f}" if e.k else ""
        line += f", mean reward {e.mean_reward:.4f} over {e.prompts} prompts"
        if e.step in recorded:
            r = recorded[e.step]
            line += f" (the run recorded pass@1 {r.pass_at_1:.4f}, mean reward {r.mean_reward:.4f})"
        print(line)
    return status


def cmd_runs(args: argparse.Namespace) -> int:
    from gateway.progress import progress_line
    from looprl.gateway.v1 import gateway_pb2

    stub, metadata = _gateway(args)
    for run in stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=metadata).runs:
        print(f"{run.run_id:<32} {run.tenant or '-':<12} {progress_line(run)}")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    stub, metadata = _gateway(args)
    return _follow(stub, metadata, args.run_id, Path(args.report_dir))


def cmd_stop(args: argparse.Namespace) -> int:
    import grpc

    from gateway.progress import progress_line
    from looprl.gateway.v1 import gateway_pb2

    stub, metadata = _gateway(args)
    try:
        reply = stub.StopRun(
            gateway_pb2.StopRunRequest(run_id=args.run_id), metadata=metadata, timeout=args.timeout
        )
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
        print(
            f"looprl stop: the gateway did not confirm within {args.timeout:g}s that run {args.run_id} "
            "stopped; `looprl runs` shows its state",
            file=sys.stderr,
        )
        return 1
    print(progress_line(reply.run))
    return 0


def cmd_conformance(args: argparse.Namespace) -> int:
    from conformance.cli import run

    def local(contract: str) -> tuple[str, str]:
        """The local stack's service of that name, and the stack's certificates."""
        from gateway.stack import StackState

        state = StackState.load(_state_dir(args).resolve())
        names = [s.name for s in state.services] if state is not None else []
        if contract not in names:
            return "", ""
        return state.service(contract).address, str(state.tls_dir)

    return run(args, local)


def _common_options(with_defaults: bool) -> argparse.ArgumentParser:
    """--state-dir, --gateway and --token, before or after the subcommand; after it they carry no
    defaults, so they only override what was given before it."""
    common = argparse.ArgumentParser(add_help=False)
    for flag, default, text in (
        ("--state-dir", None, "local state directory (default .looprl or $LOOPRL_STATE_DIR)"),
        ("--gateway", "", "gateway gRPC address (default: the local stack's)"),
        ("--token", "", "gateway bearer token (default: the local stack's, or $LOOPRL_TOKEN)"),
    ):
        common.add_argument(flag, help=text, default=default if with_defaults else argparse.SUPPRESS)
    return common


def _recipe_fields() -> str:
    """The recipe schema's fields, for `looprl run --help` (imported only then: it loads pydantic)."""
    from services.kit.config.recipe import Recipe
    from services.kit.config.schema import help_text

    return "recipe fields (TOML tables; docs/configuration.md):\n" + help_text(Recipe)


def _default_ports():
    """StackPorts' defaults, without importing the stack module (it loads grpc): `looprl --help` stays
    instant. tests/unit/gateway/test_stack_ports.py checks they are StackPorts'."""
    from types import SimpleNamespace

    return SimpleNamespace(nats=4222, ray=26379, base=20050, http=8080)


def build_parser(recipe_help: bool = False) -> argparse.ArgumentParser:
    """`recipe_help`: list the recipe's fields under `looprl run --help`."""
    parser = argparse.ArgumentParser(
        prog="looprl",
        description="RL post-training of language models as services.",
        parents=[_common_options(with_defaults=True)],
    )
    commands = parser.add_subparsers(dest="command", required=True)
    after = _common_options(with_defaults=False)

    def add_command(name: str, parents: tuple = (after,), **kwargs) -> argparse.ArgumentParser:
        return commands.add_parser(name, parents=list(parents), **kwargs)

    defaults = _default_ports()
    ports = argparse.ArgumentParser(add_help=False)  # where a local stack listens (up, run --local)
    ports.add_argument("--nats-port", type=int, default=defaults.nats)
    ports.add_argument(
        "--ray-port",
        type=int,
        default=defaults.ray,
        help="the Ray head's GCS; its other ports are the next six",
    )
    ports.add_argument(
        "--base-port",
        type=int,
        default=defaults.base,
        help="first gRPC port; metrics at +100 (keep them below the kernel's ephemeral range, 32768+)",
    )
    ports.add_argument("--http-port", type=int, default=defaults.http)
    p = add_command(
        "up", help="start nats-server, a Ray head and every service locally", parents=[after, ports]
    )
    p.add_argument(
        "--recipe",
        help="serve this recipe's deployments from the start, to one run (without: every run its own)",
    )
    p.add_argument("--keep-state", action="store_true", help="keep the JetStream state of the last stack")
    p.add_argument(
        "--plugin-dir",
        action="append",
        default=[],
        help="directory of user code (environments, rewards, task sources) the services may load",
    )
    p.add_argument(
        "--use",
        action="append",
        default=[],
        metavar="ROLE=HOST:PORT[@IDENTITY]",
        help="a part started elsewhere in place of looprl's: a service (reward, environment-sandbox, ...; its "
        "certificate issued to IDENTITY, the service's name by default) or an inference-engine serving --recipe's "
        "deployment; checked (TLS, health, contract) before the stack is ready",
    )
    p.add_argument(
        "--data-dir",
        action="append",
        default=[],
        help="directory recipes' datasets may be read from (besides the plugin directories)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address every process listens on; this host's own address makes it the head of several hosts",
    )
    p.add_argument(
        "--cert-host",
        action="append",
        default=[],
        help="address of another host (whose Ray node runs replicas or ranks) every certificate names",
    )
    p.add_argument(
        "--ray-resources",
        default="",
        help="custom resources of the Ray head as JSON, e.g. '{\"trainer_node\": 1}' (recipes place by them)",
    )
    p.set_defaults(func=cmd_up)
    add_command("down", help="stop everything `up` started").set_defaults(func=cmd_down)
    p = add_command("status", help="health, address and pid of every service")
    p.add_argument(
        "--listeners",
        action="store_true",
        help="every port the stack listens on, its interface and what guards it (docs/listeners.md)",
    )
    p.set_defaults(func=cmd_status)
    p = add_command("restart", help="restart one service of the local stack on the same ports")
    p.add_argument("service", help="service name as `looprl status` shows it (or nats-server, ray-head)")
    p.add_argument("--kill", action="store_true", help="SIGKILL it first, as a crash would")
    p.set_defaults(func=cmd_restart)
    p = add_command(
        "certs", help="write a development CA, per-service certificates and NATS users into a directory"
    )
    p.add_argument("out", help="directory (an existing ca.crt/ca.key there is reused)")
    p.add_argument("--host", action="append", default=[], help="extra DNS name or IP for every certificate")
    p.add_argument(
        "--identity",
        action="append",
        default=[],
        help="issue only this identity's certificate (e.g. for a part written outside looprl), from DIR's CA",
    )
    p.set_defaults(func=cmd_certs)
    p = add_command(
        "run",
        help="submit a recipe and follow the run",
        parents=[after, ports],
        epilog=_recipe_fields() if recipe_help else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("recipe")
    p.add_argument(
        "--local", action="store_true", help="bring a local stack up (and down after) unless one is running"
    )
    p.add_argument("--keep-up", action="store_true", help="with --local, leave the stack running")
    p.add_argument(
        "--plugin-dir",
        action="append",
        default=[],
        help="with --local, a directory of user code the services may load",
    )
    p.add_argument(
        "--data-dir",
        action="append",
        default=[],
        help="with --local, a directory recipes' datasets may be read from",
    )
    p.add_argument("--report-dir", default="reports")
    p.set_defaults(func=cmd_run)
    add_command("runs", help="list runs").set_defaults(func=cmd_runs)
    p = add_command("eval", help="evaluate a run's weights of one step on its held-out split")
    p.add_argument("run_id")
    p.add_argument("--step", type=int, default=None, help="the step whose weights (default: the run's last)")
    p.add_argument("--model-dir", default="", help="its Hugging Face export (default: the local trainer's)")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the export to appear")
    p.add_argument("--report-dir", default="reports")
    p.set_defaults(func=cmd_eval)
    for name, func, text in (("watch", cmd_watch, "follow a run"), ("stop", cmd_stop, "stop a run")):
        p = add_command(name, help=text)
        p.add_argument("run_id")
        if name == "watch":
            p.add_argument("--report-dir", default="reports")
        else:
            p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the stop")
        p.set_defaults(func=func)
    p = add_command(
        "conformance",
        help="check a server against a looprl contract (docs/conformance.md)",
        description="Run a contract's conformance cases against a server by address.",
    )
    conformance_arguments(p)
    p.set_defaults(func=cmd_conformance)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    recipe_help = "run" in words and bool({"-h", "--help"} & set(words))
    args = build_parser(recipe_help).parse_args(argv)
    if args.command == "conformance":
        # The kit provokes failed handshakes on purpose; gRPC's own log lines about them are noise.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    import grpc

    from gateway.stack import StackAlreadyUp, unwind_on_terminate
    from services.kit.local.infra import PortInUseError, StartupFailed

    try:
        with unwind_on_terminate():
            return args.func(args)
    except KeyboardInterrupt:
        return 130
    except PortInUseError as exc:
        print(f"looprl: {exc} ({_port_option(args, exc.port)})", file=sys.stderr)
        return 2
    except StackAlreadyUp as exc:
        print(f"looprl: {exc}", file=sys.stderr)
        return 2
    except StartupFailed as exc:  # what the part that died said; `up` brought the rest down
        print(f"looprl: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:  # the gateway's refusal, in its own words
        print(f"looprl: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


def _port_option(args: argparse.Namespace, port: int) -> str:
    """The option that moves `port`, one of the ports the command was given."""
    for option in ("nats_port", "ray_port", "http_port"):
        if getattr(args, option, None) == port:
            return "--" + option.replace("_", "-")
    return "--base-port: the services' gRPC ports, metrics at +100"


if __name__ == "__main__":
    sys.exit(main())
