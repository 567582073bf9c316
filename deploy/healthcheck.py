"""Container health probe: exit 0 only when the service's grpc.health.v1 answers SERVING.

Used as the Docker HEALTHCHECK of every looprl service image and as the Kubernetes probe of every
service that requires client certificates (the kubelet's native gRPC probe cannot present one).
Reads the port from LOOPRL_GRPC_PORT and the service's own certificate from LOOPRL_TLS_CA_FILE,
LOOPRL_TLS_CERT_FILE and LOOPRL_TLS_KEY_FILE (the kit's own settings), so the probe and the server
can never disagree; health is open to any certificate of the stack's CA. --plaintext for the
gateway, whose gRPC port takes no client certificates. Exit codes: 0 SERVING, 1 anything else (NOT_SERVING while
starting or draining, connection refused, timeout), 2 misconfiguration.

    python healthcheck.py [--service looprl.trainer.v1.TrainerService] [--timeout 2] [--plaintext]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

TLS_FILES = ("LOOPRL_TLS_CA_FILE", "LOOPRL_TLS_CERT_FILE", "LOOPRL_TLS_KEY_FILE")


def tls_files(environ: dict[str, str] | None = None) -> tuple[bytes, bytes, bytes] | None:
    """(CA, certificate, key) PEM bytes named by the environment; None when none is set."""
    env = os.environ if environ is None else environ
    paths = [env.get(name, "") for name in TLS_FILES]
    if not any(paths):
        return None
    if not all(paths):
        raise ValueError(f"set all of {', '.join(TLS_FILES)} or none")
    ca, cert, key = (Path(path).read_bytes() for path in paths)
    return ca, cert, key


def check(
    address: str, service: str = "", timeout: float = 2.0, tls: tuple[bytes, bytes, bytes] | None = None
) -> tuple[bool, str]:
    """(serving, human-readable status) of one gRPC health check; mutual TLS when tls is given."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        ca, cert, key = tls
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        channel = grpc.secure_channel(address, creds)
    try:
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
    except grpc.RpcError as exc:
        return False, f"{address}: {exc.code().name}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {name}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", default=os.environ.get("LOOPRL_GRPC_PORT", ""))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--service", default="", help="health service name; empty = whole server")
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--plaintext", action="store_true", help="no TLS (the gateway's public port)")
    args = parser.parse_args(argv)
    if not args.port or not args.port.isdigit() or int(args.port) == 0:
        print(f"healthcheck: LOOPRL_GRPC_PORT must be a fixed port, got {args.port!r}", file=sys.stderr)
        return 2
    try:
        tls = None if args.plaintext else tls_files()
    except (OSError, ValueError) as exc:
        print(f"healthcheck: TLS settings: {exc}", file=sys.stderr)
        return 2
    serving, status = check(f"{args.host}:{args.port}", args.service, args.timeout, tls)
    print(status)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
