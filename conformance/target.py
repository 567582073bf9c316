"""The service under test and how the kit reaches it: its address, the certificates the kit calls
with (one per caller identity, so each RPC is called as an identity allowed to call it), and the
session a contract's cases share.

Certificates come from a directory laid out as `looprl certs` writes it (ca.crt and
<identity>.crt/.key per identity) or from one CA/certificate/key triple; `insecure` calls in
plaintext (a service run for local development without TLS), and the cases that check mutual TLS
and authorization are skipped then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from conformance.case import CaseFailed, CaseSkipped, check
from services.kit.rpc import authz

DEFAULT_TIMEOUT_S = 20.0
MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class Identity:
    name: str
    cert: bytes
    key: bytes


@dataclass
class Credentials:
    """The CA that signs the service's certificate, and the client identities the kit may use."""

    ca: bytes
    identities: dict[str, Identity] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, directory: str | Path) -> Credentials:
        from services.kit.rpc.tls import certificate_identity

        d = Path(directory)
        ca_file = d / "ca.crt"
        if not ca_file.is_file():
            raise ValueError(f"--tls-dir {d}: no ca.crt there (the layout `looprl certs` writes)")
        out = cls(ca_file.read_bytes())
        for cert_file in sorted(d.glob("*.crt")):
            key_file = cert_file.with_suffix(".key")
            if cert_file.name == "ca.crt" or not key_file.is_file():
                continue
            cert = cert_file.read_bytes()
            name = certificate_identity(cert)
            out.identities[name] = Identity(name, cert, key_file.read_bytes())
        if not out.identities:
            raise ValueError(f"--tls-dir {d}: no <identity>.crt with its .key")
        return out

    @classmethod
    def from_files(cls, ca: str, cert: str, key: str) -> Credentials:
        from services.kit.rpc.tls import certificate_identity

        pem = Path(cert).read_bytes()
        name = certificate_identity(pem)
        return cls(Path(ca).read_bytes(), {name: Identity(name, pem, Path(key).read_bytes())})


@dataclass
class Target:
    address: str
    credentials: Credentials | None = None
    """None: plaintext."""
    server_name: str = ""
    """The name the service's certificate must carry, when it is not its address."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    options: dict[str, str] = field(default_factory=dict)


class Session:
    """One contract's run against a target: channels per identity, calls, and shared facts."""

    def __init__(self, target: Target, service: str) -> None:
        self.target = target
        self.service = service
        self.facts: dict[str, Any] = {}
        self._channels: dict[str | None, grpc.Channel] = {}
        self.cleanups: list[Callable[[], None]] = []

    # ---- channels ------------------------------------------------------------------------------

    @property
    def secure(self) -> bool:
        return self.target.credentials is not None

    def channel(self, identity: str | None = None) -> grpc.Channel:
        """A channel presenting `identity`'s certificate (None: no client certificate, or the only
        identity given); plaintext without credentials."""
        key = identity
        if key not in self._channels:
            self._channels[key] = self._open(identity)
        return self._channels[key]

    def _open(self, identity: str | None, with_client_cert: bool = True) -> grpc.Channel:
        options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        creds = self.target.credentials
        if creds is None:
            return grpc.insecure_channel(self.target.address, options=options)
        if self.target.server_name:
            options.append(("grpc.ssl_target_name_override", self.target.server_name))
        chosen = creds.identities.get(identity) if identity else None
        if identity and chosen is None:
            raise CaseSkipped(
                f"no certificate for identity {identity!r} (have: {', '.join(creds.identities)})"
            )
        if chosen is None and with_client_cert and len(creds.identities) == 1:
            chosen = next(iter(creds.identities.values()))
        channel_creds = grpc.ssl_channel_credentials(
            root_certificates=creds.ca,
            private_key=chosen.key if chosen else None,
            certificate_chain=chosen.cert if chosen else None,
        )
        return grpc.secure_channel(self.target.address, channel_creds, options=options)

    def anonymous_channel(self) -> grpc.Channel:
        """A TLS channel that trusts the service's CA but presents no client certificate."""
        if self.target.credentials is None:
            raise CaseSkipped("plaintext target (--insecure): mutual TLS is not checked")
        return self._open(None, with_client_cert=False)

    def caller(self, method: str, service: str | None = None) -> str | None:
        """An identity allowed to call `method` of the service under test (authz table) that the kit
        has a certificate for; None in plaintext or with one identity only."""
        creds = self.target.credentials
        if creds is None:
            return None
        allowed = authz.allowed_callers(f"/{service or self.service}/{method}")
        for name in sorted(allowed):
            if name in creds.identities:
                return name
        if len(creds.identities) == 1:
            return None
        raise CaseSkipped(
            f"no certificate of an identity allowed to call {method} (allowed: {', '.join(sorted(allowed))})"
        )

    def outsider(self, method: str) -> str:
        """An identity the kit holds a certificate for that may NOT call `method`."""
        creds = self.target.credentials
        if creds is None:
            raise CaseSkipped("plaintext target (--insecure): authorization is not checked")
        allowed = authz.allowed_callers(f"/{self.service}/{method}")
        for name in sorted(creds.identities):
            if name not in allowed:
                return name
        raise CaseSkipped(f"every identity the kit holds may call {method}")

    def close(self) -> None:
        for cleanup in reversed(self.cleanups):
            try:
                cleanup()
            except Exception:
                pass
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    # ---- calls ---------------------------------------------------------------------------------

    def _path(self, method: str, service: str | None) -> str:
        return f"/{service or self.service}/{method}"

    def unary(
        self,
        method: str,
        request: Any,
        response_type: Any,
        *,
        timeout: float | None = None,
        identity: str | None = None,
        service: str | None = None,
        channel: grpc.Channel | None = None,
    ) -> Any:
        """Call a unary RPC as an identity allowed to call it (or `identity`)."""
        chosen = channel or self.channel(identity or self.caller(method, service))
        call = chosen.unary_unary(
            self._path(method, service),
            request_serializer=_serialize,
            response_deserializer=response_type.FromString,
        )
        return call(request, timeout=timeout or self.target.timeout_s)

    def unary_stream(
        self, method: str, request: Any, response_type: Any, *, timeout: float | None = None
    ) -> Any:
        call = self.channel(self.caller(method)).unary_stream(
            self._path(method, None),
            request_serializer=_serialize,
            response_deserializer=response_type.FromString,
        )
        return call(request, timeout=timeout or self.target.timeout_s)

    def stream_unary(
        self, method: str, requests: Iterable[Any], response_type: Any, *, timeout: float | None = None
    ) -> Any:
        call = self.channel(self.caller(method)).stream_unary(
            self._path(method, None),
            request_serializer=_serialize,
            response_deserializer=response_type.FromString,
        )
        return call(iter(requests), timeout=timeout or self.target.timeout_s)

    # ---- expectations --------------------------------------------------------------------------

    def refused(
        self, codes: str | tuple[str, ...], call: Callable[[], Any], naming: str | None = None
    ) -> grpc.RpcError:
        """Run `call` (streams consumed), expecting it to fail with one of `codes`; with `naming`,
        the message must name that field. Returns the error."""
        wanted = (codes,) if isinstance(codes, str) else codes
        try:
            reply = call()
            if isinstance(reply, Iterator):
                reply = list(reply)
        except grpc.RpcError as exc:
            code = exc.code().name
            check(code in wanted, f"answered {code} ({exc.details()}), expected {' or '.join(wanted)}")
            if naming:
                check(
                    naming in (exc.details() or ""),
                    f"{code} does not name the field {naming!r}: {exc.details()!r}",
                )
            return exc
        raise CaseFailed(f"answered OK ({_short(reply)}), expected {' or '.join(wanted)}")

    def option(self, name: str, default: str = "") -> str:
        return self.target.options.get(name, default)

    def need(self, fact: str, why: str) -> Any:
        """A fact an earlier case established; skips naming `why` when it is missing."""
        if fact not in self.facts:
            raise CaseSkipped(why)
        return self.facts[fact]


def _serialize(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _short(reply: Any) -> str:
    text = str(reply).replace("\n", " ")
    return text if len(text) < 160 else text[:157] + "..."
