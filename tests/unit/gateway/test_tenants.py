"""The tenants table: tokens are configured by their SHA-256 only, each maps to its tenant (the plain
tokens list to the admin tenant), anything else is UNAUTHENTICATED, and a bad table stops the
gateway at start-up naming the variable."""

from __future__ import annotations

import json

import pytest

from gateway.auth import TokenAuth
from gateway.config import GatewayConfig, Tenant, token_sha256
from services.kit.config.service import ConfigError, load_config
from services.kit.rpc.errors import Unauthenticated


def tenant_json(name: str, token: str, **quota) -> dict:
    return {
        "name": name,
        "token_sha256": token_sha256(token),
        "max_concurrent_runs": 1,
        "max_cpus": 8,
        "max_gpus": 4,
        **quota,
    }


def config(**env: str) -> GatewayConfig:
    return load_config(GatewayConfig, "GATEWAY", {f"LOOPRL_GATEWAY_{k.upper()}": v for k, v in env.items()})


def test_each_token_authenticates_as_its_own_tenant_and_a_wrong_one_is_refused(tmp_path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(
        f"""
[[tenants]]
name = "team-b"
token_sha256 = "{token_sha256("token-b").upper()}"
max_concurrent_runs = 2
max_cpus = 16
max_gpus = 0
priority = 5
"""
    )
    auth = TokenAuth.from_config(
        config(tenants=json.dumps([tenant_json("team-a", "token-a")]), tenants_file=str(path), tokens="root")
    )
    a, b, root = (auth.check(f"Bearer {t}") for t in ("token-a", "token-b", "root"))
    assert (a.name, a.admin, a.max_gpus) == ("team-a", False, 4)
    assert (b.name, b.admin, b.max_concurrent_runs, b.priority) == ("team-b", False, 2, 5)
    assert (root.name, root.admin) == ("admin", True)
    for header in ("Bearer token-c", "Bearer " + token_sha256("token-a"), "token-a", "", None):
        with pytest.raises(Unauthenticated):
            auth.check(header)


def test_the_plain_tokens_list_keeps_working_as_admins() -> None:
    auth = TokenAuth.from_config(config(tokens="one, two"))
    assert auth.check("Bearer two").admin and auth.check("Bearer one").name == "admin"
    with pytest.raises(Unauthenticated, match="no tokens configured"):
        TokenAuth.from_config(config()).check("Bearer one")


def test_tenants_see_only_their_own_runs_and_admins_every_run() -> None:
    a = Tenant.model_validate(tenant_json("team-a", "x"))
    admin = Tenant.model_validate(tenant_json("ops", "y", admin=True))
    assert a.sees("team-a") and not a.sees("team-b") and not a.sees("")
    assert admin.sees("team-b") and admin.sees("")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"tenants": json.dumps([{**tenant_json("a", "t"), "token_sha256": "t"}])},
            "LOOPRL_GATEWAY_TENANTS[0].token_sha256",
        ),
        ({"tenants": json.dumps([tenant_json("a", "t", max_gpus=-1)])}, "max_gpus: must be >= 0.0"),
        (
            {"tenants": json.dumps([{k: v for k, v in tenant_json("a", "t").items() if k != "max_cpus"}])},
            "max_cpus: is required",
        ),
        (
            {"tenants": json.dumps([tenant_json("a", "t"), tenant_json("a", "u")])},
            "tenant name 'a' is given twice",
        ),
        (
            {"tenants": json.dumps([tenant_json("a", "t"), tenant_json("b", "t")])},
            "token_sha256 is another tenant's",
        ),
        (
            {"tenants": json.dumps([tenant_json("admin", "t")]), "tokens": "x"},
            "the tenant of the tokens list",
        ),
        ({"tenants_file": "/no/such/tenants.toml"}, "LOOPRL_GATEWAY_TENANTS_FILE: cannot read"),
    ],
    ids=["plain-token", "negative-quota", "missing-quota", "dup-name", "dup-token", "admin-name", "no-file"],
)
def test_a_bad_tenants_table_is_a_config_error_naming_the_variable(env: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config(**env)
    assert message in str(err.value)
