"""Which contract a server says it serves, read over server reflection and compared with looprl's.

A part serves a contract version when reflection lists the service under looprl's full name (the
package carries the major version: `looprl.reward.v1`) and that service has every RPC of looprl's
definition with the same request and response types and the same streaming, and every field of
those messages that both sides define has the same number and type. New fields and RPCs are
additive (buf's FILE breaking rules), so a part built from an older v1 still matches; a renamed,
retyped or missing one does not. Used by the kit's reflection case and by `looprl up --use`.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor

REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"

# Every looprl contract module, so their descriptors are in the default pool.
_PROTO_MODULES = (
    "looprl.common.v1.common_pb2",
    "looprl.environment.v1.environment_pb2",
    "looprl.events.v1.events_pb2",
    "looprl.inference.v1.inference_pb2",
    "looprl.packer.v1.packer_pb2",
    "looprl.reward.v1.reward_pb2",
    "looprl.trainer.v1.trainer_pb2",
    "looprl.weightsync.v1.weightsync_pb2",
)


def expected_service(name: str) -> ServiceDescriptor:
    """looprl's own definition of service `name`."""
    import importlib

    for module in _PROTO_MODULES:
        importlib.import_module(module)
    return descriptor_pool.Default().FindServiceByName(name)


def _reflect(channel: grpc.Channel, requests: list[Any], timeout: float) -> list[Any]:
    from grpc_reflection.v1alpha import reflection_pb2

    call = channel.stream_stream(
        REFLECTION,
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return list(call(iter(requests), timeout=timeout))


def listed_services(channel: grpc.Channel, timeout: float = 10.0) -> list[str]:
    from grpc_reflection.v1alpha import reflection_pb2

    [reply] = _reflect(channel, [reflection_pb2.ServerReflectionRequest(list_services="")], timeout)
    if reply.HasField("error_response"):
        raise ValueError(f"reflection: {reply.error_response.error_message}")
    return [s.name for s in reply.list_services_response.service]


def served_service(channel: grpc.Channel, name: str, timeout: float = 10.0) -> ServiceDescriptor:
    """The definition of service `name` as the server's reflection describes it."""
    from grpc_reflection.v1alpha import reflection_pb2

    [reply] = _reflect(
        channel, [reflection_pb2.ServerReflectionRequest(file_containing_symbol=name)], timeout
    )
    if reply.HasField("error_response"):
        raise ValueError(f"reflection has no file defining {name}: {reply.error_response.error_message}")
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in reply.file_descriptor_response.file_descriptor_proto
    ]
    pool = descriptor_pool.DescriptorPool()
    pending = {f.name: f for f in files}
    wanted = set(pending)
    # Dependencies the server did not send (well-known types) come from the default pool.
    while pending:
        added = False
        for fname, proto in list(pending.items()):
            missing = [d for d in proto.dependency if d in pending]
            if missing:
                continue
            for dep in proto.dependency:
                if dep not in wanted:
                    _add_from_default(pool, dep)
            pool.Add(proto)
            del pending[fname]
            added = True
        if not added:
            raise ValueError(f"reflection: files with circular dependencies: {sorted(pending)}")
    return pool.FindServiceByName(name)


def _add_from_default(pool: descriptor_pool.DescriptorPool, filename: str) -> None:
    try:
        pool.FindFileByName(filename)
        return
    except KeyError:
        pass
    source = descriptor_pool.Default().FindFileByName(filename)
    proto = descriptor_pb2.FileDescriptorProto()
    source.CopyToProto(proto)
    for dep in proto.dependency:
        _add_from_default(pool, dep)
    pool.Add(proto)


def contract_problems(channel: grpc.Channel, name: str, timeout: float = 10.0) -> list[str]:
    """What keeps the server on `channel` from serving looprl's contract `name` (empty: it does)."""
    try:
        listed = listed_services(channel, timeout)
    except (grpc.RpcError, ValueError) as exc:
        return [f"server reflection does not answer: {_why(exc)}"]
    if name not in listed:
        return [f"reflection does not list {name} (it lists: {', '.join(sorted(listed)) or 'nothing'})"]
    try:
        served = served_service(channel, name, timeout)
    except (grpc.RpcError, ValueError, KeyError, TypeError) as exc:
        return [f"reflection does not describe {name}: {_why(exc)}"]
    return compare_services(expected_service(name), served)


def compare_services(expected: ServiceDescriptor, served: ServiceDescriptor) -> list[str]:
    problems: list[str] = []
    seen: set[str] = set()
    for method in expected.methods:
        got = served.methods_by_name.get(method.name)
        if got is None:
            problems.append(f"{expected.full_name}.{method.name}: not served")
            continue
        for what, ours, theirs in (
            ("request", method.input_type, got.input_type),
            ("response", method.output_type, got.output_type),
        ):
            if ours.full_name != theirs.full_name:
                problems.append(
                    f"{expected.full_name}.{method.name}: {what} is {theirs.full_name}, not {ours.full_name}"
                )
            else:
                problems.extend(_compare_messages(ours, theirs, seen))
        for what, ours_flag, theirs_flag in (
            ("client streaming", method.client_streaming, got.client_streaming),
            ("server streaming", method.server_streaming, got.server_streaming),
        ):
            if ours_flag != theirs_flag:
                problems.append(
                    f"{expected.full_name}.{method.name}: {what} is {theirs_flag}, not {ours_flag}"
                )
    return problems


def _compare_messages(ours: Descriptor, theirs: Descriptor, seen: set[str]) -> list[str]:
    if ours.full_name in seen:
        return []
    seen.add(ours.full_name)
    problems = []
    theirs_by_number = {f.number: f for f in theirs.fields}
    for field in ours.fields:
        other = theirs_by_number.get(field.number)
        if other is None:
            continue  # an older v1 without this field: additive, compatible on the wire
        if other.name != field.name or _kind(other) != _kind(field):
            problems.append(
                f"{ours.full_name}.{field.name} (field {field.number}): served as "
                f"{other.name} {_kind(other)}, not {_kind(field)}"
            )
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            problems.extend(_compare_messages(field.message_type, other.message_type, seen))
    return problems


def _kind(field: FieldDescriptor) -> str:
    repeated = "repeated " if field.is_repeated else ""
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return f"{repeated}{field.message_type.full_name}"
    if field.type == FieldDescriptor.TYPE_ENUM:
        return f"{repeated}{field.enum_type.full_name}"
    names = {v: k for k, v in vars(FieldDescriptor).items() if k.startswith("TYPE_")}
    return f"{repeated}{names[field.type][5:].lower()}"


def _why(exc: Exception) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
