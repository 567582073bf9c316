"""gRPC aio server bootstrap shared by every service.

A Service owns one grpc.aio server with mutual TLS (services/kit/rpc/tls.py), the standard health
service (SERVING only once the service's setup finished, NOT_SERVING while draining), server
reflection, message size limits, the kit interceptor (caller authorization, tracing, metrics, error
mapping, input validation) and a Prometheus /metrics endpoint on its own port. SIGTERM/SIGINT drain it: health goes NOT_SERVING, new
RPCs get UNAVAILABLE, in-flight RPCs finish within the grace period, shutdown hooks run
(stop consumers, hand back work, drain NATS), then telemetry is flushed.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from services.kit.config.service import ServiceConfig, advertised_host
from services.kit.local.infra import PortInUseError, free_port, port_is_free
from services.kit.process import gc_freeze
from services.kit.rpc import tls
from services.kit.rpc.interceptors import ServerInterceptor, client_interceptors
from services.kit.rpc.raw_requests import add_with_raw_requests
from services.kit.telemetry.logs import setup_logging
from services.kit.telemetry.tracing import setup_tracing, shutdown_tracing

log = logging.getLogger("looprl.server")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def grpc_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [*tls.message_limits(max_message_bytes), ("grpc.so_reuseport", 0)]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def start_metrics_server(
    port: int, host: str, routes: Mapping[str, Callable[[], bytes]] | None = None
) -> ThreadingWSGIServer:
    """Prometheus /metrics (any path but `routes`') on host:port (0: a port the kernel picks, read
    from the returned server's server_port), in a daemon thread; each of `routes` answers its path
    with the JSON its function returns (the router's scrape targets)."""
    metrics = make_wsgi_app()
    extra = dict(routes or {})

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        route = extra.get(environ.get("PATH_INFO", ""))
        if route is None:
            return metrics(environ, start_response)
        body = route()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = make_server(host, port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return httpd


def open_channel(address: str, max_message_bytes: int = 64 * 1024 * 1024) -> grpc.aio.Channel:
    """A client channel with the kit's message limits and trace propagation, presenting this
    process's certificate (services/kit/rpc/tls.py)."""
    return tls.aio_channel(address, grpc_options(max_message_bytes), client_interceptors())


class Service:
    """One service process: register servicers with add(), then `await run(setup)`.

    The process adopts `name` as its TLS identity (refusing, with ConfigError, to exist without
    certificates unless config.insecure_plaintext). Its server requires a client certificate from
    the same CA and checks every RPC against services/kit/rpc/authz.py; a `public` service (the gateway,
    which authenticates users by token) serves without client certificates but still calls its
    peers with its own."""

    def __init__(self, name: str, config: ServiceConfig, public: bool = False) -> None:
        self.name = name
        self.config = config
        self.public = public
        self.credentials = tls.configure(name, config)
        self.grpc_port = config.grpc_port
        self.metrics_port = config.metrics_port
        self._service_names: list[str] = []
        self._adders: list[tuple[Callable[[Any, grpc.aio.Server], None], Any]] = []
        self._shutdown_hooks: list[Callable[[], Awaitable[None]]] = []
        # Paths of the metrics port besides /metrics, each answered with its function's JSON.
        self.metrics_routes: dict[str, Callable[[], bytes]] = {}
        self._state = "starting"
        self._stopping = asyncio.Event() if _has_loop() else None
        self.health = health.aio.HealthServicer()
        self.interceptor = ServerInterceptor(
            name, self._gate, authorize=self.credentials is not None and not public
        )
        self.server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        """Where others reach this service: the advertised host (config.advertise_host), its port."""
        return f"{advertised_host(self.config)}:{self.grpc_port}"

    def add(
        self,
        add_to_server: Callable[[Any, grpc.aio.Server], None],
        servicer: Any,
        raw_requests: tuple[str, ...] = (),
    ) -> None:
        """Register a servicer (before run). The full service name is read from its descriptor.
        Methods named in raw_requests get their request bytes unparsed (kit/rpc/raw_requests.py)."""
        if raw_requests:
            self._adders.append(
                (lambda s, server: add_with_raw_requests(server, add_to_server, s, raw_requests), servicer)
            )
        else:
            self._adders.append((add_to_server, servicer))
        module = __import__(add_to_server.__module__, fromlist=["DESCRIPTOR"])
        pb2 = __import__(module.__name__.replace("_pb2_grpc", "_pb2"), fromlist=["DESCRIPTOR"])
        for service in pb2.DESCRIPTOR.services_by_name.values():
            if add_to_server.__name__ == f"add_{service.name}Servicer_to_server":
                self._service_names.append(service.full_name)

    def on_shutdown(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run hook during drain, in reverse order of registration."""
        self._shutdown_hooks.append(hook)

    def _gate(self) -> str | None:
        if self._state == "serving":
            return None
        return "draining" if self._state == "draining" else "not ready yet"

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ["", *self._service_names]:
            await self.health.set(name, status)

    async def start(self) -> None:
        """Bind ports and start serving health (NOT_SERVING until ready)."""
        setup_logging(self.name, self.config.log_level)
        setup_tracing(self.name, self.config.otlp_endpoint, self.config.span_log)
        self._stopping = asyncio.Event()
        if self.grpc_port and not port_is_free(self.grpc_port, self.config.host):
            raise PortInUseError(f"{self.name}: gRPC port {self.grpc_port} is already in use", self.grpc_port)
        self.server = grpc.aio.server(
            interceptors=[self.interceptor], options=grpc_options(self.config.max_message_bytes)
        )
        for add_to_server, servicer in self._adders:
            add_to_server(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        address = f"{self.config.host}:{self.grpc_port}"
        if self.credentials is None:
            log.warning(tls.INSECURE_WARNING, self.name)
        bound = tls.add_port(self.server, address, None if self.public else self.credentials)
        if bound == 0:
            raise PortInUseError(f"{self.name}: could not bind gRPC port {self.grpc_port}", self.grpc_port)
        self.grpc_port = bound
        if not self.metrics_port:
            self.metrics_port = free_port()
        elif not port_is_free(self.metrics_port, self.config.host):
            raise PortInUseError(
                f"{self.name}: metrics port {self.metrics_port} is already in use", self.metrics_port
            )
        self._metrics_server = start_metrics_server(self.metrics_port, self.config.host, self.metrics_routes)
        await self.server.start()
        await self.set_serving(False)
        log.info(
            "listening", extra={"fields": {"grpc_port": self.grpc_port, "metrics_port": self.metrics_port}}
        )

    async def mark_ready(self) -> None:
        self._state = "serving"
        await self.set_serving(True)
        gc_freeze.freeze_startup_objects()
        log.info(
            "serving", extra={"fields": {"grpc_port": self.grpc_port, "metrics_port": self.metrics_port}}
        )

    async def run(self, setup: Callable[[Service], Awaitable[None]] | None = None) -> None:
        """Start, run setup, serve until SIGTERM/SIGINT or request_stop(), then drain."""
        await self.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            if setup is not None:
                await setup(self)
            await self.mark_ready()
            assert self._stopping is not None  # start() made it
            await self._stopping.wait()
        finally:
            await self.drain()

    def request_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def drain(self) -> None:
        """NOT_SERVING, refuse new work, let in-flight RPCs finish, run hooks, flush telemetry."""
        if self._state == "stopped":
            return
        self._state = "draining"
        deadline = time.monotonic() + self.config.grace_seconds
        log.info("draining", extra={"fields": {"in_flight": self.interceptor.in_flight}})
        await self.set_serving(False)
        try:
            await asyncio.wait_for(
                self.interceptor.idle.wait(), timeout=max(0.0, deadline - time.monotonic())
            )
        except TimeoutError:
            log.warning("grace period over with %d RPCs in flight", self.interceptor.in_flight)
        for hook in reversed(self._shutdown_hooks):
            try:
                await asyncio.wait_for(hook(), timeout=max(1.0, deadline - time.monotonic()))
            except Exception:
                log.exception("shutdown hook failed")
        if self.server is not None:
            await self.server.stop(grace=max(0.0, deadline - time.monotonic()))
        self._metrics_server.shutdown()
        shutdown_tracing()
        self._state = "stopped"
        log.info("stopped")


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False
