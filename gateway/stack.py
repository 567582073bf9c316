"""The local stack behind `looprl up/down/status`: nats-server, a Ray head and every service as
its own OS process (own log file, own process group), with their ports and pids recorded in
<state_dir>/stack.json so a later `looprl down` stops exactly what `up` started.
`up` also issues the stack's development CA and one certificate per service into <state_dir>/tls
(services/kit/rpc/tls.py): every service serves and calls with mutual TLS; the CLI is `operator`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import external
from services.kit.bus import nats_auth
from services.kit.config import registry
from services.kit.local.infra import (
    RAY_GRACE_S,
    RAY_VARIABLES,
    USER_TOKEN_VARIABLES,
    NatsServer,
    RayHead,
    StartupFailed,
    ephemeral_range,
    keep_ray_logs,
    log_excerpt,
    pid_alive,
    port_is_free,
    require_free,
    stop_pid_group,
    stop_session,
)
from services.kit.rpc import tls

ROOT = Path(__file__).resolve().parent.parent

# Logical CPUs the local Ray head offers: at least 8, so a default recipe's ranks and replicas fit
# on a small machine (they are mostly idle between steps).
RAY_HEAD_CPUS = max(8, os.cpu_count() or 2)

# Served without client certificates (users authenticate with bearer tokens).
PUBLIC_SERVICES = frozenset({"gateway"})

# Each service finds its peers through these variables: LOOPRL_<address field> of the callee.
PEER_VARIABLES = {s.name: f"LOOPRL_{s.address_field.upper()}" for s in registry.SERVICES if s.address_field}


@dataclass
class ServiceProcess:
    name: str
    pid: int
    grpc_port: int
    metrics_port: int
    log: str
    module: str = ""
    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.grpc_port}"


@dataclass
class StackState:
    state_dir: str
    nats_port: int
    nats_pid: int
    ray_port: int
    ray_pid: int
    ray_token: str
    gateway_token: str
    http_port: int
    services: list[ServiceProcess] = field(default_factory=list)
    service_env: dict[str, str] = field(default_factory=dict)
    """What `up` adds to the environment of every service (so a restart gets the same); the Ray
    cluster's address and token and the users' tokens are not in it: `service_environment` gives
    them to the services that need them only."""
    nats_passwords: dict[str, str] = field(default_factory=dict)
    """Each service's NATS password (and the operator's), from kit/bus/nats_auth.py."""
    host: str = "127.0.0.1"
    """The address every process of the stack listens on (see `up`)."""
    ray_resources: dict[str, float] = field(default_factory=dict)
    """Custom resources of the Ray head (see `up`), offered again after a restart."""
    external: list[dict[str, str]] = field(default_factory=list)
    """Parts `up` started nothing for (`--use`, gateway/external.py)."""
    engine_recipe: str = ""
    """The recipe whose deployment external engines serve (registered again after a router restart)."""

    @property
    def external_parts(self) -> list[external.ExternalPart]:
        return [external.ExternalPart(**p) for p in self.external]

    @property
    def nats_url(self) -> str:
        return f"nats://{self.host}:{self.nats_port}"

    def nats_url_for(self, user: str = nats_auth.OPERATOR) -> str:
        """The NATS URL with `user`'s credentials (the plain URL on a stack without NATS users)."""
        if user not in self.nats_passwords:
            return self.nats_url
        return nats_auth.url_with_credentials(self.nats_url, user, self.nats_passwords[user])

    def service(self, name: str) -> ServiceProcess:
        return next(s for s in self.services if s.name == name)

    @property
    def tls_dir(self) -> Path:
        return Path(self.state_dir) / "tls"

    def credentials(self, identity: str = tls.OPERATOR) -> tls.Credentials:
        """An identity's certificate from this stack's CA (the CLI is `operator`)."""
        return tls.Credentials.from_dir(identity, self.tls_dir)

    def channel(self, name: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A channel to service `name`, as the operator (plaintext to the public gateway)."""
        address = self.service(name).address
        creds = None if name in PUBLIC_SERVICES else self.credentials()
        return tls.sync_channel(address, options or [], creds=creds)

    def save(self) -> None:
        path = Path(self.state_dir) / "stack.json"
        path.write_text(json.dumps(asdict(self), indent=2))
        path.chmod(0o600)

    def running(self) -> bool:
        """Whether its nats-server still runs: a stack whose nats-server is gone (killed, a reboot)
        is over, and `up` in its directory starts a new one."""
        return pid_alive(self.nats_pid)

    @classmethod
    def load(cls, state_dir: Path) -> StackState | None:
        path = state_dir / "stack.json"
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        data["services"] = [ServiceProcess(**s) for s in data["services"]]
        return cls(**data)


@dataclass
class StackPorts:
    """Where `up` listens. Every default lies below the kernel's ephemeral range (32768+ on Linux by
    default, /proc/sys/net/ipv4/ip_local_port_range), whose ports outgoing connections take at any
    moment: one chosen there can be taken between the check that it is free and the bind. They also
    stay clear of Ray's worker ports (10002-19999)."""

    nats: int = 4222
    ray: int = 26379
    """The Ray head's GCS; its other ports are the next six (RayHead.ports)."""
    base: int = 20050
    """gRPC ports are base, base+1, ...; metrics ports base+100, base+101, ..."""
    http: int = 8080

    def planned(self, host: str = "127.0.0.1") -> dict[str, int]:
        """Every port `up` binds, by what listens on it."""
        out = {"nats-server": self.nats, "gateway HTTP": self.http}
        out |= {
            f"ray head {name}": port for name, port in RayHead(Path("."), self.ray, host=host).ports().items()
        }
        for i, spec in enumerate(registry.SERVICES):
            out[f"{spec.name} gRPC"], out[f"{spec.name} metrics"] = self.base + i, self.base + 100 + i
        return out


def in_ephemeral_range(ports: dict[str, int]) -> dict[str, int]:
    """The ports that lie in this host's ephemeral range (see StackPorts)."""
    low, high = ephemeral_range()
    return {what: port for what, port in ports.items() if low <= port <= high}


def health_status(address: str, timeout: float = 1.0, creds: tls.Credentials | None = None) -> str:
    try:
        with tls.sync_channel(address, creds=creds) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        return f"DOWN ({exc.code().name})"


class StackAlreadyUp(RuntimeError):
    """`up` in a state directory whose stack is still running."""


def up(
    state_dir: Path,
    ports: StackPorts,
    extra_env: dict[str, str] | None = None,
    timeout: float = 120.0,
    log=print,
    keep_state: bool = False,
    host: str = "127.0.0.1",
    ray_resources: dict[str, float] | None = None,
    cert_hosts: tuple[str, ...] = (),
    use: tuple[external.ExternalPart, ...] = (),
    engine_recipe: str = "",
) -> StackState:
    """Start everything and wait until every service reports SERVING.

    Unless keep_state, the previous stack's JetStream state in state_dir is discarded first.
    `host`: the address nats-server, the Ray head and every service listen on and advertise; another
    than loopback makes the stack the head of several hosts: Ray workers elsewhere join its head
    (`ray start --address`), the certificates name it, and replicas bind their own node's address.
    `ray_resources`: custom resources the head node offers (the recipe's ray_resources fields place
    replicas and trainer ranks by them). `cert_hosts`: the addresses of the other hosts, which every
    certificate names too (replicas there serve with the router's certificate, ranks call with the
    trainer's, and their peers verify the address they dial). `use`: parts started elsewhere in place
    of looprl's (gateway/external.py), checked before the stack is ready; engines among them serve
    `engine_recipe`'s deployment.
    """
    state_dir = state_dir.resolve()
    existing = StackState.load(state_dir)
    if existing is not None and existing.running():
        raise StackAlreadyUp(f"a stack is already up (state in {state_dir}); run `looprl down` first")
    state_dir.mkdir(parents=True, exist_ok=True)
    if not keep_state:
        # JetStream state (runs, weight manifests, packer plans) belongs to the stack that made it.
        shutil.rmtree(state_dir / "jetstream", ignore_errors=True)
    logs = state_dir / "logs"
    logs.mkdir(exist_ok=True)
    for what, port in in_ephemeral_range(ports.planned(host)).items():
        low, high = ephemeral_range()
        log(
            f"warning: {what} port {port} lies in the kernel's ephemeral range {low}-{high}: an outgoing "
            "connection may take it before it is bound (the defaults lie below it)"
        )
    # The registry's order: callees first, the gateway (the front door) last.
    outside = {p.role for p in use}
    plan = [
        (s.name, s.package, ports.base + i, ports.base + 100 + i)
        for i, s in enumerate(registry.SERVICES)
        if s.name not in outside
    ]
    for name, _, grpc_port, metrics_port in plan:
        require_free(grpc_port, f"{name} gRPC", host)
        require_free(metrics_port, f"{name} metrics", host)
    require_free(ports.http, "gateway HTTP", host)
    started = time.monotonic()
    nats_passwords = nats_auth.new_passwords(list(registry.NAMES))
    nats = NatsServer(
        state_dir=state_dir, port=ports.nats, config=nats_auth.server_config(nats_passwords), host=host
    )
    ray = RayHead(
        state_dir=state_dir, port=ports.ray, num_cpus=RAY_HEAD_CPUS, host=host, resources=ray_resources or {}
    )
    try:
        nats.start()
        log(f"nats-server   {nats.url} (pid {nats.proc.pid})")
        ray.start()
        log(f"ray head      {ray.address} (pid {ray.proc.pid})")
    except BaseException:
        ray.stop()
        nats.stop()
        raise
    state = StackState(
        state_dir=str(state_dir),
        nats_port=nats.port,
        nats_pid=nats.proc.pid,
        ray_port=ray.port,
        ray_pid=ray.proc.pid,
        ray_token=ray.token,
        gateway_token=secrets.token_urlsafe(24),
        http_port=ports.http,
        nats_passwords=nats_passwords,
        host=host,
        ray_resources=dict(ray_resources or {}),
        external=[asdict(p) for p in use],
        engine_recipe=engine_recipe,
    )
    state.save()
    tls.generate_dev_pki(state.tls_dir, hosts=[*([] if _loopback(host) else [host]), *cert_hosts])
    env = {
        "LOOPRL_TLS_DIR": str(state.tls_dir),
        # `up` is secure whatever the caller's environment says; extra_env may still opt out.
        "LOOPRL_INSECURE_PLAINTEXT": "false",
        "LOOPRL_NATS_URL": nats.url,
        "LOOPRL_STATE_DIR": str(state_dir),
        "LOOPRL_HOST": host,
        registry.service("gateway").env_var("http_port"): str(ports.http),
        registry.service("gateway").env_var("recipe_base_dir"): os.getcwd(),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PYTHONUNBUFFERED": "1",
        # Replicas on other Ray nodes must be reachable from this host: each binds its node's address.
        **({} if _loopback(host) else {registry.service("inference-router").env_var("replica_host"): "node"}),
        **(extra_env or {}),
    }
    for name, _, grpc_port, _ in plan:
        if name in PEER_VARIABLES:
            env[PEER_VARIABLES[name]] = f"{host}:{grpc_port}"
    env.update(external.service_env(list(use), PEER_VARIABLES))
    state.service_env = env
    try:
        for name, module, grpc_port, metrics_port in plan:
            state.services.append(
                _launch(
                    state,
                    ServiceProcess(name, 0, grpc_port, metrics_port, str(logs / f"{name}.log"), module, host),
                )
            )
            state.save()
        wait_serving(state, timeout - (time.monotonic() - started))
        if use:
            external.wait_ready(list(use), state.credentials(), timeout - (time.monotonic() - started), log)
            _register_engines(state)
    except BaseException:
        down(state_dir, log=lambda *_: None)
        raise
    log(f"all {len(state.services) + len(use)} services SERVING in {time.monotonic() - started:.1f}s")
    return state


def _register_engines(state: StackState) -> None:
    """External engines serve the recipe's deployment: the router knows them only once told."""
    if any(p.role == external.ENGINE for p in state.external_parts):
        with state.channel("inference-router") as channel:
            external.register_engines(state.external_parts, state.engine_recipe, channel)


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


def service_environment(state: StackState, svc: ServiceProcess) -> dict[str, str]:
    """The environment of one service: the caller's and the stack's settings, its own NATS user and
    ports, the Ray cluster's address and token only for a Ray driver (registry `ray_driver`), and the
    users' tokens only for the gateway (least privilege: whatever runs in another service, user code
    among it, cannot read them)."""
    spec = registry.service(svc.name)
    held = (RAY_VARIABLES if spec.ray_driver else ()) + (
        USER_TOKEN_VARIABLES if svc.name == "gateway" else ()
    )
    withheld = set(RAY_VARIABLES + USER_TOKEN_VARIABLES) - set(held)
    env = {k: v for k, v in {**os.environ, **state.service_env}.items() if k not in withheld}
    if spec.ray_driver:
        address = f"{state.host}:{state.ray_port}"
        env |= {"RAY_ADDRESS": address, "LOOPRL_RAY_ADDRESS": address, "RAY_AUTH_MODE": "token"}
        env["RAY_AUTH_TOKEN"] = state.ray_token
    if svc.name == "gateway":  # the stack's token, unless `up` was given others (extra_env)
        tokens = spec.env_var("tokens")
        env[tokens] = state.service_env.get(tokens, state.gateway_token)
    env |= {
        "LOOPRL_NATS_URL": state.nats_url_for(svc.name),  # its own NATS user
        "LOOPRL_GRPC_PORT": str(svc.grpc_port),
        "LOOPRL_METRICS_PORT": str(svc.metrics_port),
    }
    return env


def _launch(state: StackState, svc: ServiceProcess) -> ServiceProcess:
    """Start one service process in its own process group; returns svc with its pid."""
    with open(svc.log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", svc.module],
            cwd=ROOT,
            env=service_environment(state, svc),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    svc.pid = proc.pid
    return svc


# What `looprl restart` can restart besides the services: the stack's own nats-server and Ray head.
INFRASTRUCTURE = ("nats-server", "ray-head")


def restart(state_dir: Path, name: str, kill: bool = False, timeout: float = 120.0) -> ServiceProcess:
    """Stop one service (SIGKILL with kill=True, as a crash would; else SIGTERM and its grace period),
    start it again on the same ports, and wait until it is SERVING. nats-server and the Ray head
    restart on their port with the same credentials (JetStream keeps its store; Ray starts empty)."""
    state = StackState.load(state_dir.resolve())
    if state is None:
        raise RuntimeError("no stack is up")
    if name in INFRASTRUCTURE:
        return _restart_infrastructure(state, name, kill)
    svc = state.service(name)
    _stop(svc.pid, kill)
    _launch(state, svc)
    state.save()
    wait_serving(StackState(**{**asdict(state), "services": [svc]}), timeout)
    if name == "inference-router":
        _register_engines(state)
    return svc


def _stop(pid: int, kill: bool) -> None:
    if kill:
        try:
            os.killpg(pid, 9)
        except ProcessLookupError:
            pass
        while pid_alive(pid):
            time.sleep(0.05)
    else:
        stop_pid_group(pid)


def _wait_port_released(port: int, host: str = "127.0.0.1", timeout: float = 30.0) -> None:
    """A killed server's accepted connections hold its port for a moment while the kernel closes
    them; the new one binds it once they are gone (its start says so if they never go)."""
    deadline = time.monotonic() + timeout
    while not port_is_free(port, host) and time.monotonic() < deadline:
        time.sleep(0.2)


def _restart_infrastructure(state: StackState, name: str, kill: bool) -> ServiceProcess:
    state_dir = Path(state.state_dir)
    if name == "nats-server":
        _stop(state.nats_pid, kill)
        _wait_port_released(state.nats_port, state.host)
        config = nats_auth.server_config(state.nats_passwords)
        state.nats_pid = (
            NatsServer(state_dir=state_dir, port=state.nats_port, config=config, host=state.host)
            .start()
            .proc.pid
        )
        port, pid = state.nats_port, state.nats_pid
    else:
        stop_session(state.ray_pid, 0.0 if kill else RAY_GRACE_S)
        _wait_port_released(state.ray_port, state.host)
        head = RayHead(
            state_dir=state_dir,
            port=state.ray_port,
            num_cpus=RAY_HEAD_CPUS,
            token=state.ray_token,
            host=state.host,
            resources=state.ray_resources,
        )
        state.ray_pid = head.start().proc.pid
        port, pid = state.ray_port, state.ray_pid
    state.save()
    return ServiceProcess(name, pid, port, 0, str(state_dir / f"{name}.log"))


def wait_serving(state: StackState, timeout: float) -> None:
    """Until every service is SERVING; StartupFailed, with the end of its own log, as soon as any
    process the stack started (a service, nats-server, the Ray head) has died."""
    deadline = time.monotonic() + timeout
    pending = {s.name: s for s in state.services}
    state_dir = Path(state.state_dir)
    infrastructure = [
        ("nats-server", state.nats_pid, state_dir / "nats-server.log"),
        ("ray head", state.ray_pid, state_dir / "ray-head.log"),
    ]
    while pending:
        for name, pid, log in infrastructure:
            if not pid_alive(pid):
                raise StartupFailed(
                    f"{name} exited while the services started; its log says:\n{log_excerpt(log)}"
                )
        for name, svc in list(pending.items()):
            if not pid_alive(svc.pid):
                raise StartupFailed(
                    f"{name} exited during start-up; last log lines:\n{log_excerpt(Path(svc.log))}"
                )
            if _health(state, svc, timeout=0.5) == "SERVING":
                del pending[name]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(
                f"not SERVING after {timeout:.0f}s: {', '.join(sorted(pending))} (see their logs)"
            )
        time.sleep(0.2)


@contextmanager
def unwind_on_terminate() -> Iterator[None]:
    """Inside the block, SIGTERM and SIGHUP (a scheduler stopping the job, a closed terminal) unwind
    the program like Ctrl-C does, so a stack it brought up is brought down again; the exit status
    is 128 plus the signal's number. A second such signal while unwinding is ignored: the stack
    still comes down (Ctrl-C or SIGKILL stop the program at once). The handlers before the block
    are restored after it. Main thread only, where signals land."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum: int, _frame: Any) -> None:
        for other in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(other, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    before = {sig: signal.signal(sig, unwind) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def down(state_dir: Path, grace: float = 15.0, log=print) -> bool:
    """Stop services (reverse order), then the Ray head and nats-server. False if nothing was up."""
    state = StackState.load(state_dir.resolve())
    if state is None:
        log("nothing is up")
        return False
    for svc in reversed(state.services):
        if pid_alive(svc.pid):
            os.killpg(svc.pid, 15)
    for svc in reversed(state.services):
        killed = stop_pid_group(svc.pid, grace)
        log(f"stopped {svc.name}{' (killed after grace)' if killed else ''}")
    stop_session(state.ray_pid, RAY_GRACE_S)
    keep_ray_logs(state.ray_port, Path(state.state_dir))
    log("stopped ray head")
    stop_pid_group(state.nats_pid, grace)
    log("stopped nats-server")
    (Path(state.state_dir) / "stack.json").unlink(missing_ok=True)
    return True


def status_rows(state: StackState) -> list[dict[str, str]]:
    rows = [
        {
            "name": "nats-server",
            "health": "UP" if pid_alive(state.nats_pid) else "DOWN",
            "address": state.nats_url,
            "pid": str(state.nats_pid),
        },
        {
            "name": "ray-head",
            "health": "UP" if pid_alive(state.ray_pid) else "DOWN",
            "address": f"{state.host}:{state.ray_port}",
            "pid": str(state.ray_pid),
        },
    ]
    for svc in state.services:
        health = _health(state, svc) if pid_alive(svc.pid) else "DOWN (no process)"
        rows.append({"name": svc.name, "health": health, "address": svc.address, "pid": str(svc.pid)})
    if state.external:
        rows += external.status_rows(state.external_parts, state.credentials())
    return rows


def _health(state: StackState, svc: ServiceProcess, timeout: float = 1.0) -> str:
    plaintext = svc.name in PUBLIC_SERVICES or not state.tls_dir.exists()
    return health_status(svc.address, timeout, None if plaintext else state.credentials())
