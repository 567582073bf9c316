"""Typed service configuration from environment variables (12-factor).

Each service declares a pydantic model deriving from ServiceConfig (services/kit/config/schema.py: each
field's type, default, constraint and docstring together). `load_config(MyConfig, "PACKER")` reads
LOOPRL_PACKER_<FIELD>, falling back to LOOPRL_<FIELD>; a table- or list-typed field is given as JSON.
An error names the variable and what is allowed. This module imports nothing heavy so entry points
can parse config before importing torch.
"""

from __future__ import annotations

import json
import os
import re
import types
import typing
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import Field, ValidationError, field_validator

from services.kit.config.schema import Schema, error_path, explain

T = TypeVar("T", bound="ServiceConfig")


class ConfigError(ValueError):
    """A configuration value could not be parsed."""


class ServiceConfig(Schema):
    """Settings every service has."""

    host: str = "127.0.0.1"
    """Interface the gRPC and metrics servers bind (0.0.0.0: every interface)."""
    advertise_host: str = ""
    """Address other hosts reach this service at (what it reports and registers); empty: `host`, or this
    machine's primary address when `host` is 0.0.0.0 or ::."""
    grpc_port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 picks a free port (logged)."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Prometheus /metrics port; 0 picks a free port."""
    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL."""
    nats_credentials_file: str = ""
    """File holding this service's NATS `user:password` (a mounted secret); added to nats_url. Empty: the
    credentials, if any, are in nats_url."""
    ray_address: str = ""
    """Ray head address host:port; empty starts a private local Ray."""
    on_ray_head_loss: Literal["restart", "exit"] = "restart"
    """When the joined Ray head is lost: restart this process in place once a new head is up, or exit
    with status 75 for a supervisor that first rejoins the new cluster (the container entrypoint)."""
    state_dir: str = ".looprl"
    """Directory for local state and checkpoints."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    """Python logging level."""
    otlp_endpoint: str = ""
    """OTLP/gRPC endpoint for traces (e.g. localhost:4317); empty disables."""
    span_log: str = ""
    """If set, finished spans are appended to this file as JSON lines."""
    grace_seconds: float = Field(10.0, ge=0.0)
    """On SIGTERM, time allowed for in-flight work before exit."""
    max_message_bytes: int = Field(64 * 1024 * 1024, ge=1024, le=2**31 - 1)
    """Largest gRPC message accepted or sent."""
    tls_dir: str = ""
    """Directory with ca.crt and <service>.crt/.key (what `looprl up` writes); used when the tls_*_file fields
    are empty."""
    tls_ca_file: str = ""
    """PEM CA certificate(s) that sign every peer this service accepts."""
    tls_cert_file: str = ""
    """PEM certificate of this service; its common name is the identity."""
    tls_key_file: str = ""
    """PEM private key of tls_cert_file."""
    external_identities: dict[str, str] = {}
    """Certificate identities of parts that are not looprl's own, each with the service it stands in for
    (e.g. {"acme-reward": "reward"}): a caller presenting that certificate is authorized as that service.
    Set by `looprl up --use`."""
    insecure_plaintext: bool = Field(
        default_factory=lambda: _env_flag("LOOPRL_INSECURE_PLAINTEXT"),
        json_schema_extra={"shown_default": "LOOPRL_INSECURE_PLAINTEXT, else False"},
    )
    """Serve and call gRPC without TLS or caller checks (local development only; logged as a warning). Without
    it a service with no certificates refuses to start."""

    @field_validator("external_identities")
    @classmethod
    def _stands_in_for_a_service(cls, value: dict[str, str]) -> dict[str, str]:
        from services.kit.config.registry import NAMES

        for identity, service in value.items():
            if identity in NAMES or identity == "operator":
                raise ValueError(f"{identity!r} is looprl's own identity and cannot stand in for another")
            if service not in NAMES or service == "gateway":
                raise ValueError(f"{identity!r} stands in for {service!r}, not a service behind the gateway")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _level_in_capitals(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


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
        from services.kit.process.hosts import primary_address

        return primary_address()
    return config.host


def _is_plain(tp: object) -> bool:
    """Whether an environment string is the value itself (str, int, float, bool, a Literal of
    strings), not JSON."""
    if typing.get_origin(tp) is Literal:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return all(_is_plain(a) for a in typing.get_args(tp) if a is not type(None))
    return tp in (str, int, float, bool)


def _read_field(env: typing.Mapping[str, str], var: str, tp: object) -> tuple[object, str] | None:
    """The value of one field from `var` (plain, or JSON for tables and lists), or for a nested
    settings group from `var__<SUBFIELD>` variables over `var`'s JSON; None when nothing is set."""
    value: object = None
    if var in env:
        raw = env[var]
        if _is_plain(tp):
            return raw, var
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{var}: not valid JSON ({exc}): {raw!r}") from None
    if isinstance(tp, type) and issubclass(tp, Schema):
        nested = {}
        for sub, info in tp.model_fields.items():
            found = _read_field(env, f"{var}__{sub.upper()}", info.annotation)
            if found is not None:
                nested[sub] = found[0]
        if nested:
            return {**(value if isinstance(value, dict) else {}), **nested}, var
    return (value, var) if var in env else None


def load_config(cls: type[T], service: str, environ: typing.Mapping[str, str] | None = None) -> T:
    """Build `cls` from LOOPRL_<SERVICE>_<FIELD> or LOOPRL_<FIELD> environment variables."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    source: dict[str, str] = {}
    for name, info in cls.model_fields.items():
        for prefix in (f"LOOPRL_{service.upper()}_{name.upper()}", f"LOOPRL_{name.upper()}"):
            found = _read_field(env, prefix, info.annotation)
            if found is not None:
                values[name], source[name] = found
                break
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = error_path(tuple(error["loc"]), error.get("ctx"))
        name = re.match(r"[^.\[]*", path).group(0)  # type: ignore[union-attr]
        var = source.get(name, f"LOOPRL_{service.upper()}_{name.upper()}")
        rest = path[len(name) :]
        nested = re.match(r"\.(\w+)(.*)", rest)
        if nested and f"{var}__{nested.group(1).upper()}" in env:
            var, rest = f"{var}__{nested.group(1).upper()}", nested.group(2)
        message = explain(exc, cls).partition(": ")[2]
        raise ConfigError(f"{var}{rest}: {message}") from None
