"""Which contract version a server serves, read from its reflection: looprl's own definition matches,
and a missing RPC, a retyped or renamed field, or another streaming shape is named."""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool

from conformance.served import compare_services, expected_service

SERVICE = "looprl.reward.v1.RewardService"


def _served(edit) -> object:
    """looprl's reward contract as another server would describe it, after `edit` changed its file."""
    ours = expected_service(SERVICE).file
    proto = descriptor_pb2.FileDescriptorProto()
    ours.CopyToProto(proto)
    edit(proto)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return pool.FindServiceByName(SERVICE)


def _message(proto, name):
    return next(m for m in proto.message_type if m.name == name)


def test_looprls_own_definition_serves_the_contract() -> None:
    assert compare_services(expected_service(SERVICE), _served(lambda p: None)) == []


def test_a_missing_rpc_is_named() -> None:
    def drop(proto):
        service = proto.service[0]
        kept = [m for m in service.method if m.name != "ScoreBatch"]
        del service.method[:]
        service.method.extend(kept)

    assert compare_services(expected_service(SERVICE), _served(drop)) == [f"{SERVICE}.ScoreBatch: not served"]


def test_a_retyped_field_is_named_and_an_extra_one_is_fine() -> None:
    def retype(proto):
        score = next(f for f in _message(proto, "ScoreResponse").field if f.name == "score")
        score.type = descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT
        _message(proto, "ScoreRequest").field.add(name="added_later", number=99, type=9, label=1)

    problems = compare_services(expected_service(SERVICE), _served(retype))
    assert problems == ["looprl.reward.v1.ScoreResponse.score (field 1): served as score float, not double"]


def test_another_streaming_shape_is_named() -> None:
    def stream(proto):
        next(m for m in proto.service[0].method if m.name == "Score").server_streaming = True

    assert compare_services(expected_service(SERVICE), _served(stream)) == [
        f"{SERVICE}.Score: server streaming is True, not False"
    ]
