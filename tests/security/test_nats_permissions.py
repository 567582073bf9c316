"""NATS users and publish permissions on a real nats-server configured as `looprl up` configures it:
no credentials or a wrong password cannot connect, and every service may publish only on the
subjects the owner table (services/kit/bus/nats_auth.py) gives it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from services.kit.bus import nats_auth, subjects
from services.kit.bus.client import Bus, BusUnavailable
from services.kit.config.registry import NAMES
from services.kit.local.infra import NatsServer, free_port

# One concrete subject per owned pattern.
EXAMPLES = {pattern: pattern.replace("*", "r1").replace(">", "k1") for pattern in nats_auth.OWNERS}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, dict[str, str]]]:
    passwords = nats_auth.new_passwords(list(NAMES))
    server = NatsServer(
        state_dir=Path(tmp_path_factory.mktemp("nats")),
        port=free_port(),
        config=nats_auth.server_config(passwords),
    ).start()
    try:
        yield server, passwords
    finally:
        server.stop()


def _url(server: NatsServer, passwords: dict[str, str], user: str) -> str:
    return nats_auth.url_with_credentials(server.url, user, passwords[user])


async def _published(url: str, subject: str) -> bool:
    """Whether JetStream stored a message `user` published on `subject`."""
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        await nc.jetstream().publish(subject, b"forged?", timeout=1.0)
        return True
    except (TimeoutError, nats.errors.Error):
        return False
    finally:
        await nc.close()


async def test_without_credentials_or_with_a_wrong_password_nothing_connects(secured) -> None:
    server, passwords = secured
    with pytest.raises(BusUnavailable, match="refused the credentials"):
        await Bus.connect(server.url, name="anonymous", connect_timeout_s=3)
    wrong = nats_auth.url_with_credentials(server.url, "trainer", passwords["gateway"])
    with pytest.raises(BusUnavailable, match="refused the credentials") as info:
        await Bus.connect(wrong, name="trainer", connect_timeout_s=3)
    assert passwords["gateway"] not in str(info.value)  # the password is not in the error


async def test_each_service_publishes_only_on_the_subjects_it_owns(secured) -> None:
    server, passwords = secured
    operator = await Bus.connect(_url(server, passwords, nats_auth.OPERATOR), name="operator")
    try:
        await operator.ensure_streams(buckets=(*subjects.BUCKETS, subjects.BucketSpec("packer")))
    finally:
        await operator.close()
    cases = [
        (service, pattern, service in owners)
        for service in NAMES
        for pattern, owners in nats_auth.OWNERS.items()
    ]
    results = await asyncio.gather(
        *(_published(_url(server, passwords, service), EXAMPLES[pattern]) for service, pattern, _ in cases)
    )
    wrong = [
        f"{service} {'could not' if allowed else 'could'} publish on {pattern}"
        for (service, pattern, allowed), published in zip(cases, results, strict=True)
        if published != allowed
    ]
    assert not wrong, wrong
    assert sum(results) == sum(len(owners) for owners in nats_auth.OWNERS.values())
    # and no service may delete a stream; the operator may
    for service in NAMES:
        nc = await nats.connect(_url(server, passwords, service), connect_timeout=5)
        try:
            with pytest.raises((TimeoutError, nats.errors.Error)):
                await nc.jetstream().delete_stream(subjects.TRAIN)
        finally:
            await nc.close()
    nc = await nats.connect(_url(server, passwords, nats_auth.OPERATOR), connect_timeout=5)
    try:
        assert (await nc.jetstream().stream_info(subjects.TRAIN)).state.messages == 1  # the trainer's
    finally:
        await nc.close()


async def test_the_stack_looprl_up_starts_refuses_anonymous_nats_clients(stack) -> None:
    with pytest.raises(BusUnavailable, match="refused the credentials"):
        await Bus.connect(stack.state.nats_url, name="anonymous", connect_timeout_s=3)
    bus = await Bus.connect(stack.state.nats_url_for(nats_auth.OPERATOR), name="operator")
    await bus.close()
