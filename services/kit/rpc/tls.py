"""Service identities for mutual TLS: a development CA, per-service certificates, and the one place
every gRPC server and client of the stack gets its transport credentials from.

A service's identity is the common name of its certificate (also a DNS SAN, beside localhost and
127.0.0.1 so local addresses verify). `looprl up` writes a CA and one certificate per identity into
<state_dir>/tls; real deployments mount their own (cert-manager or any CA) and point the
ServiceConfig tls_* fields at them. A process adopts one identity (`configure`): its servers then
require a client certificate from the same CA, and its channels present its own certificate.
Without certificates a service refuses to start, unless `insecure_plaintext` is set for local
development, which is logged as a warning at start-up.
Ray actors of a service (trainer ranks, engine replicas) run in other processes: they get the
service's credentials with `export()` in their constructor arguments and `adopt()` them.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # the schema (pydantic) loads only where a service configures itself
    from services.kit.config.service import ServiceConfig

log = logging.getLogger("looprl.tls")

OPERATOR = "operator"

# Every identity `looprl up` issues a certificate for: the services, and `operator` for the local
# CLI (`looprl status`) and the stack's own health checks.
IDENTITIES: tuple[str, ...] = (
    "gateway",
    "inference-router",
    "environment-sandbox",
    "reward",
    "rollout-packer",
    "trainer",
    "weight-sync",
    OPERATOR,
)
CERT_DAYS = 365
INSECURE_WARNING = (
    "%s: TLS is OFF (insecure_plaintext): gRPC is served and called in plaintext and no caller is "
    "authenticated. Local development only."
)


def _config_error(message: str) -> Exception:
    from services.kit.config.service import ConfigError

    return ConfigError(message)


@dataclass(frozen=True)
class Credentials:
    """One identity's PEM key and certificate, and the CA that signs every peer it accepts."""

    identity: str
    ca: bytes
    cert: bytes
    key: bytes

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    @classmethod
    def from_files(cls, identity: str, ca_file: str, cert_file: str, key_file: str) -> Credentials:
        parts = {}
        for label, path in (
            ("tls_ca_file", ca_file),
            ("tls_cert_file", cert_file),
            ("tls_key_file", key_file),
        ):
            try:
                parts[label] = Path(path).read_bytes()
            except OSError as exc:
                raise _config_error(f"{identity}: {label}: cannot read {path!r}: {exc.strerror}") from exc
        found = certificate_identity(parts["tls_cert_file"])
        if found != identity:
            raise _config_error(
                f"{identity}: tls_cert_file {cert_file!r} is issued to {found!r}, not to {identity!r}"
            )
        return cls(identity, parts["tls_ca_file"], parts["tls_cert_file"], parts["tls_key_file"])

    @classmethod
    def from_dir(cls, identity: str, directory: str | Path) -> Credentials:
        """ca.crt, <identity>.crt and <identity>.key in directory (the layout `looprl up` writes)."""
        d = Path(directory)
        return cls.from_files(
            identity, str(d / "ca.crt"), str(d / f"{identity}.crt"), str(d / f"{identity}.key")
        )


def certificate_identity(cert_pem: bytes) -> str:
    """The common name a PEM certificate is issued to."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    names = x509.load_pem_x509_certificate(cert_pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


# ---- the process's identity ----------------------------------------------------------------------

_NOT_CONFIGURED = object()
_process: Any = _NOT_CONFIGURED  # Credentials, None (insecure opt-out), or not configured yet


def resolve(identity: str, config: ServiceConfig) -> Credentials | None:
    """The credentials config names for identity; None only with insecure_plaintext and no
    certificates. Raises ConfigError naming the fields when there are none."""
    files = {"tls_ca_file": config.tls_ca_file, "tls_cert_file": config.tls_cert_file}
    files["tls_key_file"] = config.tls_key_file
    if any(files.values()):
        missing = [name for name, value in files.items() if not value]
        if missing:
            raise _config_error(f"{identity}: {', '.join(missing)} not set (tls_* files go together)")
        return Credentials.from_files(identity, config.tls_ca_file, config.tls_cert_file, config.tls_key_file)
    if config.tls_dir:
        return Credentials.from_dir(identity, config.tls_dir)
    if config.insecure_plaintext:
        return None
    raise _config_error(
        f"{identity}: no TLS certificates configured. Set LOOPRL_TLS_DIR (ca.crt, {identity}.crt, "
        f"{identity}.key; `looprl up` writes them) or LOOPRL_TLS_CA_FILE/LOOPRL_TLS_CERT_FILE/"
        "LOOPRL_TLS_KEY_FILE; or, for local development only, LOOPRL_INSECURE_PLAINTEXT=true"
    )


# Certificate identities of external parts -> the service each stands in for (config.external_identities).
_stand_ins: dict[str, str] = {}


def configure(identity: str, config: ServiceConfig) -> Credentials | None:
    """Adopt identity for this process from config (see resolve); idempotent for the same one."""
    global _process
    _stand_ins.clear()
    _stand_ins.update(config.external_identities)
    if isinstance(_process, Credentials) and _process.identity == identity:
        return _process
    creds = resolve(identity, config)
    if creds is None:
        log.warning(INSECURE_WARNING, identity)
    _process = creds
    return creds


def export() -> dict[str, Any]:
    """This process's credentials as plain data, for a Ray actor of the same service to adopt()."""
    creds = current()
    if creds is None:
        return {"insecure": True}
    return {"identity": creds.identity, "ca": creds.ca, "cert": creds.cert, "key": creds.key}


def adopt(exported: dict[str, Any] | None) -> None:
    """In a Ray actor: use what export() returned in the service that created it."""
    global _process
    if not exported or exported.get("insecure"):
        _process = None
        return
    _process = Credentials(exported["identity"], exported["ca"], exported["cert"], exported["key"])


def _chosen(creds: Credentials | EllipsisType | None) -> Credentials | None:
    """`...` stands for the process's credentials (current()); None for plaintext."""
    return current() if isinstance(creds, EllipsisType) else creds


def current() -> Credentials | None:
    """This process's credentials; None when it opted into plaintext. A process that configured
    nothing may only run without TLS where LOOPRL_INSECURE_PLAINTEXT says so."""
    if _process is _NOT_CONFIGURED:
        if _env_flag("LOOPRL_INSECURE_PLAINTEXT"):
            return None
        raise RuntimeError(
            "no TLS identity configured in this process (tls.configure or tls.adopt) and "
            "LOOPRL_INSECURE_PLAINTEXT is not set"
        )
    return _process


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# ---- servers and channels ------------------------------------------------------------------------


def add_port(
    server: grpc.Server | grpc.aio.Server, address: str, creds: Credentials | EllipsisType | None = ...
) -> int:
    """Bind address with mutual TLS (the process's credentials unless given); plaintext only when
    the process opted out. Returns the bound port (0 if it could not bind)."""
    chosen = _chosen(creds)
    if chosen is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, chosen.server_credentials())


def message_limits(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel or server options raising gRPC's send and receive limits (4 MiB received by default)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


# A peer killed and restarted (a crash, a rolling update) is back within seconds, but gRPC's default
# reconnect backoff (1 s, growing 1.6x per failed attempt up to 120 s) keeps a channel failing fast for
# seconds to minutes after the peer returns: 5.5-6.1 s after a 20 s outage (tests/integration/
# test_kit_channels.py). Every channel here reaches a peer of the same deployment, cheap to retry.
RECONNECT_BACKOFF = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000))


def _with_backoff(options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    given = {name for name, _ in options}
    return [*options, *(option for option in RECONNECT_BACKOFF if option[0] not in given)]


def aio_channel(
    address: str,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[Any] | None = None,
    creds: Credentials | EllipsisType | None = ...,
) -> grpc.aio.Channel:
    chosen = _chosen(creds)
    if chosen is None:
        return grpc.aio.insecure_channel(address, options=_with_backoff(options), interceptors=interceptors)
    return grpc.aio.secure_channel(
        address,
        chosen.channel_credentials(),
        options=_with_backoff(options),
        interceptors=interceptors,
    )


def sync_channel(
    address: str, options: Sequence[tuple[str, Any]] = (), creds: Credentials | EllipsisType | None = ...
) -> grpc.Channel:
    chosen = _chosen(creds)
    if chosen is None:
        return grpc.insecure_channel(address, options=_with_backoff(options))
    return grpc.secure_channel(address, chosen.channel_credentials(), options=_with_backoff(options))


def peer_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The verified common name of the caller's certificate, or None (plaintext, or no certificate);
    an external part's identity reads as the service it stands in for (config.external_identities)."""
    auth = context.auth_context() or {}
    names = list(auth.get("x509_common_name") or [])
    if not names:
        return None
    name = names[0].decode()
    return _stand_ins.get(name, name)


# ---- the development CA ---------------------------------------------------------------------------


def generate_dev_pki(
    directory: str | Path, identities: Iterable[str] = IDENTITIES, hosts: Iterable[str] = ()
) -> Path:
    """Write ca.crt/ca.key and <identity>.crt/.key for each identity into directory (keys 0600).
    An existing CA there is kept, so certificates issued earlier stay valid; leaf certificates are
    reissued. Each leaf names its identity as CN and DNS SAN, plus localhost, 127.0.0.1, ::1 and hosts."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=CERT_DAYS)

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)

    ca_cert_path, ca_key_path = d / "ca.crt", d / "ca.key"
    if ca_cert_path.exists() and ca_key_path.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "looprl development CA")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(ca_key, hashes.SHA256())
        )
        write_key(ca_key_path, ca_key)
        ca_cert_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    extra = list(hosts)
    for identity in identities:
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName(identity), x509.DNSName("localhost")]
        for host in ["127.0.0.1", "::1", *extra]:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
        )
        write_key(d / f"{identity}.key", key)
        (d / f"{identity}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return d
