"""Gateway configuration (environment variables LOOPRL_GATEWAY_<FIELD> or LOOPRL_<FIELD>).

Who may call the gateway is a table of tenants (`Tenant`): each is a name, the SHA-256 of its
bearer token (never the token), whether it is an admin, and its quota. The table comes from
`tenants` (JSON) and/or `tenants_file` (a TOML or JSON file of `[[tenants]]`); each token of the
plain `tokens` list is the built-in admin tenant "admin" with no quota, as `looprl up` starts it.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Annotated

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from services.kit.config.limits import RecipeLimits
from services.kit.config.schema import Schema, explain, field_error
from services.kit.config.service import ServiceConfig

# Quotas of the built-in admin tenant of `tokens`, and the most any quota may be set to.
UNLIMITED_RUNS = 1_000_000
UNLIMITED_RESOURCES = 1e9
# The tenant every token of `tokens` is.
TOKENS_TENANT = "admin"


def token_sha256(token: str) -> str:
    """The hex SHA-256 of a bearer token, as a tenant's `token_sha256` holds it
    (`printf %s TOKEN | sha256sum`)."""
    return hashlib.sha256(token.encode()).hexdigest()


class Tenant(Schema):
    """One tenant ([[tenants]]): a bearer token's owner, what it may see and how much it may ask for."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """Tenant name, unique in the table (letters, digits, _ . -; at most 64); recorded on each run it creates."""
    token_sha256: Annotated[str, Field(pattern=r"^[0-9a-fA-F]{64}$")]
    """Hex SHA-256 of the tenant's bearer token (`printf %s TOKEN | sha256sum`); the token itself is never
    configured."""
    admin: bool = False
    """An admin sees, watches, stops and samples every tenant's runs; others only their own."""
    max_concurrent_runs: int = Field(ge=0, le=UNLIMITED_RUNS)
    """Most runs of this tenant active (pending or running) at once; a run beyond it is queued until one ends."""
    max_cpus: float = Field(ge=0.0, le=UNLIMITED_RESOURCES)
    """Most Ray CPUs one run of this tenant may ask for (trainer ranks + inference replicas); more is
    RESOURCE_EXHAUSTED."""
    max_gpus: float = Field(ge=0.0, le=UNLIMITED_RESOURCES)
    """Most GPUs one run of this tenant may ask for (trainer ranks + vLLM replicas); more is
    RESOURCE_EXHAUSTED."""
    priority: int = Field(0, ge=-1000, le=1000)
    """Order of the run queue: a queued run of a higher-priority tenant starts before older runs of
    lower-priority tenants."""

    @field_validator("token_sha256")
    @classmethod
    def _lower_hex(cls, value: str) -> str:
        return value.lower()

    def sees(self, owner: str) -> bool:
        """Whether this tenant may see a run owned by `owner` (a run with no owner: admins only)."""
        return self.admin or (bool(owner) and owner == self.name)


def tokens_tenant() -> Tenant:
    """The built-in admin tenant the `tokens` list authenticates as: no quota (hash unused)."""
    return Tenant(
        name=TOKENS_TENANT,
        token_sha256="0" * 64,
        admin=True,
        max_concurrent_runs=UNLIMITED_RUNS,
        max_cpus=UNLIMITED_RESOURCES,
        max_gpus=UNLIMITED_RESOURCES,
    )


class TenantsFile(Schema):
    """A tenants file: `[[tenants]]` tables (TOML), or {"tenants": [...]} (JSON)."""

    tenants: list[Tenant] = []
    """The tenants."""


def load_tenants_file(path: str | Path) -> list[Tenant]:
    """The tenants of a TOML (or, by its .json suffix, JSON) file; ValueError names the file and field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{str(path)!r} does not parse: {exc}") from None
    try:
        return TenantsFile.model_validate(data).tenants
    except ValidationError as exc:
        raise ValueError(f"{str(path)!r}: {explain(exc, TenantsFile)}") from None


class GatewayConfig(ServiceConfig):
    http_port: int = Field(0, ge=0, le=65535)
    """HTTP/JSON and OpenAI-compatible API port; 0 picks one."""
    tokens: str = ""
    """Comma-separated bearer tokens accepted on every external call, each as the admin tenant 'admin' (sees
    every run, no quota); none is built in. `looprl up` generates one."""
    tenants: list[Tenant] = []
    """Tenants as JSON ([{"name": ..., "token_sha256": ..., "max_concurrent_runs": ..., "max_cpus": ...,
    "max_gpus": ...}]), besides tenants_file and tokens."""
    tenants_file: str = ""
    """File of [[tenants]] tables (TOML; JSON {"tenants": [...]} when it ends in .json), besides tenants and
    tokens; read at start-up."""
    router_address: str = ""
    """inference-router gRPC address host:port. CreateRun also reads the Ray cluster's total resources
    from it, refuses a run that could never fit and queues one that does not fit now; without it only
    the tenants' quotas apply. The gateway never joins the cluster nor holds its token."""
    sandbox_address: str = ""
    """environment-sandbox gRPC address; CreateRun refuses environments it does not serve."""
    reward_address: str = ""
    """reward gRPC address; CreateRun refuses rewards it does not serve."""
    packer_address: str = ""
    """rollout-packer gRPC address, for drop counts."""
    tokenizer: str = "char"
    """Tokenizer of the OpenAI-compatible endpoint while the stack has no run ('char' or a local directory);
    with a run it is the run's model.tokenizer."""
    recipe_base_dir: str = "."
    """Relative model paths in recipes resolve here."""
    model_dirs: list[str] = []
    """Directories a recipe's model.path and model.tokenizer must lie under (symlinks resolved), e.g.
    ["/models"]; empty: any directory the gateway can read. A path that is missing, unreadable,
    outside them or not a model directory gets one and the same answer."""
    recipe_limits: RecipeLimits = RecipeLimits()
    """What a recipe may ask of this cluster, as JSON overriding the defaults of services.kit.config.limits.RecipeLimits (e.g.
    {"max_rollouts_per_step": 4096, "max_world_size": 8, "max_replicas": 16}); a recipe over a limit is
    refused with INVALID_ARGUMENT before its run exists."""

    _table: list[Tenant] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _one_table(self) -> GatewayConfig:
        table = list(self.tenants)
        if self.tenants_file:
            try:
                table += load_tenants_file(self.tenants_file)
            except ValueError as exc:
                raise field_error("tenants_file", str(exc)) from None
        names: set[str] = {TOKENS_TENANT} if self.token_list() else set()
        hashes = {token_sha256(t) for t in self.token_list()}
        where = "tenants_file" if self.tenants_file else "tenants"
        for tenant in table:
            if tenant.name in names:
                taken = " (the tenant of the tokens list)" if tenant.name == TOKENS_TENANT else ""
                raise field_error(where, f"tenant name {tenant.name!r} is given twice{taken}")
            if tenant.token_sha256 in hashes:
                raise field_error(where, f"tenant {tenant.name!r}: its token_sha256 is another tenant's")
            names.add(tenant.name)
            hashes.add(tenant.token_sha256)
        self._table = table
        return self

    def token_list(self) -> list[str]:
        return [t.strip() for t in self.tokens.split(",") if t.strip()]

    def tenant_table(self) -> list[tuple[str, Tenant]]:
        """(token SHA-256, tenant) for every accepted token: the table's tenants, then each of `tokens` as
        the admin tenant."""
        admin = tokens_tenant()
        return [(t.token_sha256, t) for t in self._table] + [
            (token_sha256(t), admin) for t in self.token_list()
        ]
