"""Bearer-token authentication for every external call (gRPC metadata or HTTP header): the token
names a tenant (gateway/config.py `Tenant`).

Tokens are looked up by their SHA-256, compared in constant time against every configured hash (no
early exit), so neither the tokens nor which tenant is configured leak through timing. An unknown or
missing token is UNAUTHENTICATED (HTTP 401).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from gateway.config import GatewayConfig, Tenant, token_sha256, tokens_tenant
from services.kit.rpc.errors import Unauthenticated


class TokenAuth:
    """Accepts `authorization: Bearer <token>` for any configured token and answers its tenant."""

    def __init__(self, tokens: Iterable[str] = (), tenants: Iterable[tuple[str, Tenant]] = ()) -> None:
        """`tokens`: plain tokens, each the admin tenant; `tenants`: (hex SHA-256 of a token, its tenant)."""
        admin = tokens_tenant()
        entries = [(token_sha256(t.strip()), admin) for t in tokens if t.strip()] + list(tenants)
        self._entries = [(bytes.fromhex(digest), tenant) for digest, tenant in entries]

    @classmethod
    def from_config(cls, config: GatewayConfig) -> TokenAuth:
        return cls(tenants=config.tenant_table())

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def tenant_of(self, token: str) -> Tenant | None:
        """The tenant whose token this is, or None; every configured hash is compared."""
        presented = hashlib.sha256(token.encode()).digest()
        found = None
        for digest, tenant in self._entries:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    def check(self, authorization: str | None) -> Tenant:
        """The caller's tenant; Unauthenticated unless the header carries an accepted token."""
        if not self._entries:
            raise Unauthenticated(
                "gateway has no tokens configured (set LOOPRL_GATEWAY_TOKENS or tenants); refusing all calls"
            )
        if not authorization:
            raise Unauthenticated("missing 'authorization: Bearer <token>' header")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("authorization header must be 'Bearer <token>'")
        tenant = self.tenant_of(token.strip())
        if tenant is None:
            raise Unauthenticated("invalid bearer token")
        return tenant

    def check_grpc(self, context) -> Tenant:
        metadata = dict(context.invocation_metadata() or ())
        return self.check(metadata.get("authorization"))
