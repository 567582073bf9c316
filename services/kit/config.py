"""Typed service configuration from environment variables (12-factor).

Each service declares a dataclass deriving from ServiceConfig; every field has a default and a
`help` string. `load_config(MyConfig, "PACKER")` reads LOOPRL_PACKER_<FIELD>, falling back to
LOOPRL_<FIELD>, and converts by the field's type, naming the variable in any error.
This module imports nothing heavy so entry points can parse config before importing torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value could not be parsed."""


@dataclass
class ServiceConfig:
    """Settings every service has."""

    host: str = field(
        default="127.0.0.1",
        metadata={"help": "Interface the gRPC and metrics servers bind (0.0.0.0: every interface)."},
    )
    advertise_host: str = field(
        default="",
        metadata={"help": "Address other hosts reach this service at (what it reports and registers); empty: "
                          "`host`, or this machine's primary address when `host` is 0.0.0.0 or ::."},
    )  # fmt: skip
    grpc_port: int = field(default=0, metadata={"help": "gRPC port; 0 picks a free port (logged)."})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus /metrics port; 0 picks a free port."})
    nats_url: str = field(default="nats://127.0.0.1:4222", metadata={"help": "NATS server URL."})
    nats_credentials_file: str = field(
        default="",
        metadata={"help": "File holding this service's NATS `user:password` (a mounted secret); added to "
                          "nats_url. Empty: the credentials, if any, are in nats_url."},
    )  # fmt: skip
    ray_address: str = field(
        default="", metadata={"help": "Ray head address host:port; empty starts a private local Ray."}
    )
    state_dir: str = field(default=".looprl", metadata={"help": "Directory for local state and checkpoints."})
    log_level: str = field(default="INFO", metadata={"help": "Python logging level."})
    otlp_endpoint: str = field(
        default="", metadata={"help": "OTLP/gRPC endpoint for traces (e.g. localhost:4317); empty disables."}
    )
    span_log: str = field(
        default="", metadata={"help": "If set, finished spans are appended to this file as JSON lines."}
    )
    grace_seconds: float = field(
        default=10.0, metadata={"help": "On SIGTERM, time allowed for in-flight work before exit."}
    )
    max_message_bytes: int = field(
        default=64 * 1024 * 1024, metadata={"help": "Largest gRPC message accepted or sent."}
    )
    tls_dir: str = field(
        default="",
        metadata={
            "help": "Directory with ca.crt and <service>.crt/.key (what `looprl up` writes); used when "
            "the tls_*_file fields are empty."
        },
    )
    tls_ca_file: str = field(
        default="", metadata={"help": "PEM CA certificate(s) that sign every peer this service accepts."}
    )
    tls_cert_file: str = field(
        default="", metadata={"help": "PEM certificate of this service; its common name is the identity."}
    )
    tls_key_file: str = field(default="", metadata={"help": "PEM private key of tls_cert_file."})
    insecure_plaintext: bool = field(
        default_factory=lambda: _env_flag("LOOPRL_INSECURE_PLAINTEXT"),
        metadata={
            "help": "Serve and call gRPC without TLS or caller checks (local development only; logged "
            "as a warning). Without it a service with no certificates refuses to start."
        },
    )


def bus_url(config: ServiceConfig) -> str:
    """nats_url with the credentials of nats_credentials_file, when one is configured."""
    if not config.nats_credentials_file:
        return config.nats_url
    try:
        user, sep, password = Path(config.nats_credentials_file).read_text().strip().partition(":")
    except OSError as exc:
        raise ConfigError(
            f"nats_credentials_file: cannot read {config.nats_credentials_file}: {exc}"
        ) from exc
    if not sep or not user or not password:
        raise ConfigError(f"nats_credentials_file: {config.nats_credentials_file} must hold user:password")
    scheme, _, rest = config.nats_url.partition("://")
    return f"{scheme}://{user}:{password}@{rest.rpartition('@')[2]}"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def advertised_host(config: ServiceConfig) -> str:
    """The host part of the address this service gives others (see `advertise_host`)."""
    if config.advertise_host:
        return config.advertise_host
    if config.host in ("", "0.0.0.0", "::"):
        from services.kit.hosts import primary_address

        return primary_address()
    return config.host


def _convert(raw: str, tp: Any, var: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw == "" and len(args) < len(typing.get_args(tp)):
            return None
        return _convert(raw, args[0], var)
    try:
        if tp is bool:
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"expected true/false, got {raw!r}")
        if tp in (int, float, str):
            return tp(raw)
        if origin in (list, dict) or tp in (list, dict):
            return json.loads(raw)
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{var}: cannot parse {raw!r} as {getattr(tp, '__name__', tp)}: {exc}") from exc
    raise ConfigError(f"{var}: unsupported config type {tp}")


def load_config(cls: type[T], service: str, environ: typing.Mapping[str, str] | None = None) -> T:
    """Build `cls` from LOOPRL_<SERVICE>_<FIELD> or LOOPRL_<FIELD> environment variables."""
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        for var in (f"LOOPRL_{service.upper()}_{f.name.upper()}", f"LOOPRL_{f.name.upper()}"):
            if var in env:
                values[f.name] = _convert(env[var], hints[f.name], var)
                break
    return cls(**values)


def describe(cls: type) -> list[tuple[str, str, str]]:
    """(field, default, help) rows, for --help output and docs."""
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append((f.name, repr(default), f.metadata.get("help", "")))
    return rows
