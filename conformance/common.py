"""What every contract promises besides its RPCs: health, reflection of the contract it serves,
mutual TLS, authorization by caller identity, and a clear refusal of bytes that do not parse.

Each service definition in protos/ states them in the same paragraph, which these cases quote.
"""

from __future__ import annotations

from typing import Any

from conformance.case import Contract, check
from conformance.served import contract_problems
from conformance.target import Session

HEALTH = "/grpc.health.v1.Health/Check"
GARBAGE = b"\xff\xff\xff\xff\x0f\x00garbage"

HEALTH_QUOTE = "grpc.health.v1 health service (SERVING once the RPCs below are answered"
REFLECTION_QUOTE = "server reflection listing this service"
NO_CERT_QUOTE = "without one nothing is answered"
IDENTITY_QUOTE = "may not call an RPC is PERMISSION_DENIED"
MALFORMED_QUOTE = "A request that does not parse is INVALID_ARGUMENT"


def health(session: Session, service: str = "", identity: str | None = None) -> str:
    from grpc_health.v1 import health_pb2

    channel = session.channel(identity or _any_identity(session))
    call = channel.unary_unary(
        HEALTH,
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    reply = call(health_pb2.HealthCheckRequest(service=service), timeout=session.target.timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _any_identity(session: Session) -> str | None:
    creds = session.target.credentials
    if creds is None or len(creds.identities) <= 1:
        return None
    return "operator" if "operator" in creds.identities else sorted(creds.identities)[0]


def add_common(contract: Contract, probe: str, probe_request: Any) -> None:
    """The cases every contract shares. `probe` is a unary RPC of the contract that changes nothing
    (a list or status call) and `probe_request` a valid request for it."""
    service = contract.service

    @contract.case(
        "health.serving",
        "Health",
        "Health.Check answers SERVING for the server and for the contract's service",
        "OK",
        service,
        HEALTH_QUOTE,
    )
    def _health(s: Session) -> None:
        for name in ("", service):
            status = health(s, name)
            check(status == "SERVING", f"Health.Check(service={name!r}) is {status}, not SERVING")

    @contract.case(
        "reflection.contract",
        "Reflection",
        "reflection lists the service with every RPC of the contract, its types and streaming",
        "OK",
        service,
        REFLECTION_QUOTE,
    )
    def _reflection(s: Session) -> None:
        problems = contract_problems(s.channel(_any_identity(s)), service, s.target.timeout_s)
        check(not problems, "; ".join(problems))

    @contract.case(
        "auth.client_certificate",
        probe,
        "a caller without a client certificate of the CA is answered nothing",
        "UNAVAILABLE",
        service,
        NO_CERT_QUOTE,
    )
    def _no_certificate(s: Session) -> None:
        channel = s.anonymous_channel()
        try:
            s.refused(
                ("UNAVAILABLE", "UNAUTHENTICATED"),
                lambda: s.unary(probe, probe_request, type(probe_request), channel=channel, timeout=5),
            )
        finally:
            channel.close()

    @contract.case(
        "auth.identity",
        probe,
        "a caller whose identity may not call the RPC is refused naming it",
        "PERMISSION_DENIED",
        service,
        IDENTITY_QUOTE,
    )
    def _wrong_identity(s: Session) -> None:
        outsider = s.outsider(probe)
        s.refused(
            "PERMISSION_DENIED", lambda: s.unary(probe, probe_request, type(probe_request), identity=outsider)
        )

    @contract.case(
        "malformed.request",
        probe,
        "a request whose bytes do not parse is refused, and the service keeps serving",
        "INVALID_ARGUMENT",
        service,
        MALFORMED_QUOTE,
    )
    def _malformed(s: Session) -> None:
        s.refused("INVALID_ARGUMENT", lambda: s.unary(probe, GARBAGE, type(probe_request)))
        status = health(s)
        check(status == "SERVING", f"after a malformed request Health.Check is {status}")
