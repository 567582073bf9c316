"""How rollouts travel on the ROLLOUTS stream.

environment-sandbox publishes an episode task's rollouts (a GRPO group) as `RolloutGroup` messages,
as few as the server's max_payload allows (one for any group of ordinary size), marked by the
header `looprl-event: rollout-group`. A message without that header carries one bare `Rollout`,
which any other producer may still publish. One message per group instead of one per sample is 8x
fewer publishes, deliveries and acks on the default recipe (bench/rollout_messages.py).

A message's id (JetStream `Nats-Msg-Id`) is a hash of the rollout ids it carries: rollout ids are
deterministic, so a task that runs again publishes the same messages and the stream drops them as
duplicates inside its window; the packer drops any rollout it already holds or trained after that.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from looprl.common.v1 import common_pb2
from services.kit.bus.consumer import Delivery
from services.kit.bus.subjects import EVENT_HEADER

ROLLOUT_GROUP = "rollout-group"
GROUP_HEADERS = {EVENT_HEADER: ROLLOUT_GROUP}
# Room left under max_payload for the message's headers (message id, traceparent, event).
HEADER_ALLOWANCE = 4096


def group_messages(rollouts: Sequence[common_pb2.Rollout], max_payload: int) -> list[tuple[bytes, str]]:
    """(payload, message id) of each RolloutGroup message carrying `rollouts`, in order, each at most
    max_payload bytes with its headers. A rollout too large to share a message travels alone (and
    the publish reports it when even that is too large)."""
    budget = max(1, max_payload - HEADER_ALLOWANCE)
    messages: list[tuple[bytes, str]] = []
    batch: list[common_pb2.Rollout] = []
    size = 0
    for rollout in rollouts:
        # A repeated message field costs its tag byte, the length varint and the message itself.
        nbytes = rollout.ByteSize()
        field = 1 + _varint_size(nbytes) + nbytes
        if batch and size + field > budget:
            messages.append(_message(batch))
            batch, size = [], 0
        batch.append(rollout)
        size += field
    if batch:
        messages.append(_message(batch))
    return messages


def rollouts_in(delivery: Delivery) -> list[common_pb2.Rollout]:
    """The rollouts a ROLLOUTS message carries; PoisonMessage when its payload does not parse."""
    if is_group(delivery.headers):
        return list(delivery.parse(common_pb2.RolloutGroup).rollouts)
    return [delivery.parse(common_pb2.Rollout)]


def decode(data: bytes, headers: Mapping[str, str] | None) -> list[common_pb2.Rollout]:
    """`rollouts_in` for a message read without a Delivery (DecodeError when it does not parse)."""
    if is_group(headers):
        return list(common_pb2.RolloutGroup.FromString(data).rollouts)
    return [common_pb2.Rollout.FromString(data)]


def is_group(headers: Mapping[str, str] | None) -> bool:
    """Whether a message with these headers is a RolloutGroup (else one bare Rollout)."""
    return (headers or {}).get(EVENT_HEADER) == ROLLOUT_GROUP


def _message(rollouts: list[common_pb2.Rollout]) -> tuple[bytes, str]:
    payload = common_pb2.RolloutGroup(rollouts=rollouts).SerializeToString()
    digest = hashlib.blake2b("\n".join(r.rollout_id for r in rollouts).encode(), digest_size=16)
    return payload, f"rollouts-{digest.hexdigest()}"


def _varint_size(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)
