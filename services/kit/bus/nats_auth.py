"""Who may publish what on the bus: per-service NATS users and the one table of subject owners.

`looprl up` gives every service its own NATS user and password and starts nats-server with the
configuration `server_config` writes: a connection without credentials is refused, and a service's
user may not publish on a subject another service owns (a record there changes a run's state, so a
compromised environment-sandbox must not be able to forge a trainer step or a weight version). KV
writes are publishes to `$KV.<bucket>.<key>`, so bucket ownership is the same rule. Subscribing,
the JetStream API and acks stay open to every stack user: consumers read every stream they follow,
and acking is how they consume. Deleting or purging a stream is for the operator only.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from services.kit.bus import subjects

OPERATOR = "operator"  # the stack's own tooling and tests; may publish anywhere

# Subject pattern -> the services allowed to publish on it.
OWNERS: dict[str, frozenset[str]] = {
    subjects.all_runs(subjects.Kind.EPISODES): frozenset({"gateway"}),
    subjects.all_runs(subjects.Kind.ROLLOUTS): frozenset({"environment-sandbox"}),
    subjects.all_runs(subjects.Kind.TRAIN): frozenset({"trainer"}),
    subjects.all_runs(subjects.Kind.WEIGHTS): frozenset({"weight-sync"}),
    subjects.all_runs(subjects.Kind.EVENTS): frozenset(
        {"environment-sandbox", "inference-router", "trainer", "weight-sync"}
    ),
    f"$KV.{subjects.RUNS}.>": frozenset({"gateway"}),
    f"$KV.{subjects.WEIGHTS_KV}.>": frozenset({"weight-sync"}),
    f"$KV.{subjects.PACKER_STEPS}.>": frozenset({"rollout-packer"}),
    f"$KV.{subjects.TRAINER_EPOCHS}.>": frozenset({"trainer"}),
}
OPERATOR_ONLY = ("$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>")


def denied(service: str) -> list[str]:
    """The subjects `service` may not publish on."""
    if service == OPERATOR:
        return []
    return [pattern for pattern, owners in OWNERS.items() if service not in owners] + list(OPERATOR_ONLY)


def new_passwords(services: list[str]) -> dict[str, str]:
    return {name: secrets.token_urlsafe(24) for name in [*services, OPERATOR]}


def server_config(passwords: dict[str, str]) -> str:
    """nats-server `authorization` block: one user per service with its publish permissions."""
    users = []
    for user, password in passwords.items():
        entry = f"    {{user: {json.dumps(user)}, password: {json.dumps(password)}"
        deny = denied(user)
        if deny:
            entry += f', permissions: {{publish: {{allow: [">"], deny: {json.dumps(deny)}}}}}'
        users.append(entry + "}")
    return "authorization {\n  users: [\n" + ",\n".join(users) + "\n  ]\n}\n"


def url_with_credentials(url: str, user: str, password: str) -> str:
    """nats://host:port -> nats://user:password@host:port (nats-py reads credentials from the URL)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{user}:{password}@{rest}"


def write_credentials(directory: str | Path, services: list[str]) -> dict[str, str]:
    """For compose or Kubernetes: nats-server.conf and one `nats-<user>.creds` (user:password) per
    user in directory, every file 0600; returns the passwords."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    passwords = new_passwords(services)
    files = {"nats-server.conf": server_config(passwords)}
    files.update({f"nats-{user}.creds": f"{user}:{password}\n" for user, password in passwords.items()})
    for name, text in files.items():
        fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return passwords
