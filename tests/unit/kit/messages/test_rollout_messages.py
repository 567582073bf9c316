"""A task's rollouts as RolloutGroup messages: one message for an ordinary group, split under the
server's max_payload, decoded back in order, with ids that a re-run task reproduces."""

from __future__ import annotations

from bench.harness.synthetic_rollouts import make_rollout
from looprl.common.v1 import common_pb2
from services.kit.bus.subjects import EVENT_HEADER
from services.kit.messages import rollouts as rollout_messages

NATS_DEFAULT_MAX_PAYLOAD = 1024 * 1024


def _group(n: int, completion_len: int = 4) -> list[common_pb2.Rollout]:
    return [
        make_rollout(f"g-{i}", "g", group_size=n, sample_index=i, completion_len=completion_len, seed=i)
        for i in range(n)
    ]


def _decoded(messages: list[tuple[bytes, str]]) -> list[common_pb2.Rollout]:
    return [
        r for payload, _ in messages for r in rollout_messages.decode(payload, rollout_messages.GROUP_HEADERS)
    ]


def test_a_group_of_ordinary_size_is_one_message_that_decodes_to_its_rollouts_in_order() -> None:
    group = _group(8)
    messages = rollout_messages.group_messages(group, NATS_DEFAULT_MAX_PAYLOAD)
    assert len(messages) == 1
    assert _decoded(messages) == group
    assert rollout_messages.GROUP_HEADERS == {EVENT_HEADER: rollout_messages.ROLLOUT_GROUP}


def test_a_group_over_max_payload_is_split_into_messages_that_each_fit() -> None:
    group = _group(8, completion_len=200)
    one_rollout = group[0].ByteSize()
    max_payload = rollout_messages.HEADER_ALLOWANCE + 3 * one_rollout + 64  # room for three
    messages = rollout_messages.group_messages(group, max_payload)
    assert [len(common_pb2.RolloutGroup.FromString(p).rollouts) for p, _ in messages] == [3, 3, 2]
    assert all(len(p) <= max_payload - rollout_messages.HEADER_ALLOWANCE for p, _ in messages)
    assert _decoded(messages) == group
    assert len({msg_id for _, msg_id in messages}) == 3


def test_a_rollout_too_large_to_share_a_message_travels_alone() -> None:
    group = _group(3, completion_len=200)
    messages = rollout_messages.group_messages(group, rollout_messages.HEADER_ALLOWANCE + 10)
    assert [len(common_pb2.RolloutGroup.FromString(p).rollouts) for p, _ in messages] == [1, 1, 1]


def test_message_ids_follow_from_the_rollout_ids_alone() -> None:
    group = _group(8)
    again = _group(8)
    again[0].reward = 0.5  # a re-run scores differently: the stream must still see a duplicate
    ids = [m for _, m in rollout_messages.group_messages(group, NATS_DEFAULT_MAX_PAYLOAD)]
    assert ids == [m for _, m in rollout_messages.group_messages(again, NATS_DEFAULT_MAX_PAYLOAD)]
    other = [m for _, m in rollout_messages.group_messages(_group(7), NATS_DEFAULT_MAX_PAYLOAD)]
    assert other != ids


def test_a_message_without_the_group_header_is_one_bare_rollout() -> None:
    rollout = _group(1)[0]
    assert rollout_messages.decode(rollout.SerializeToString(), None) == [rollout]
    assert rollout_messages.decode(rollout.SerializeToString(), {"other": "header"}) == [rollout]
