"""Bearer-token authentication for every external call (gRPC metadata or HTTP header)."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from services.kit.errors import Unauthenticated


class TokenAuth:
    """Accepts `authorization: Bearer <token>` for any configured token (constant-time compare)."""

    def __init__(self, tokens: Iterable[str]) -> None:
        self._tokens = [t.strip().encode() for t in tokens if t.strip()]

    @classmethod
    def from_config(cls, tokens: str) -> TokenAuth:
        return cls(tokens.split(","))

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def check(self, authorization: str | None) -> None:
        """Raise Unauthenticated unless the header carries an accepted token."""
        if not self._tokens:
            raise Unauthenticated(
                "gateway has no tokens configured (set LOOPRL_GATEWAY_TOKENS); refusing all calls"
            )
        if not authorization:
            raise Unauthenticated("missing 'authorization: Bearer <token>' header")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("authorization header must be 'Bearer <token>'")
        if not any(hmac.compare_digest(token.strip().encode(), known) for known in self._tokens):
            raise Unauthenticated("invalid bearer token")

    def check_grpc(self, context) -> None:
        metadata = dict(context.invocation_metadata() or ())
        self.check(metadata.get("authorization"))
