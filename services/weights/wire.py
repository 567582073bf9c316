"""StageWeightsRequest on the wire, built without protobuf copying the payload.

Protobuf's Python API would copy each slice's bytes into the message and again when it
serializes. A bucket is instead encoded by hand: small headers serialized by protobuf, the
payload spliced in as memoryviews, one join. Parsers accept fields in any order, so the
result is a valid StageWeightsRequest for any receiver (tests check it round-trips).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from looprl.inference.v1 import inference_pb2

from .bucket import Bucket

_LEN = 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


_SLICES = _key(2, _LEN)
_DATA = _key(5, _LEN)


def encode_stage_request(
    bucket: Bucket,
    payload: memoryview,
    *,
    version: int,
    rank: int = 0,
    deployment: str = "",
    model_config_json: str = "",
    total_bytes: int = 0,
    slice_data: Sequence | None = None,
    commit_when_complete: bool = False,
    adapter: str = "",
) -> bytes:
    """Serialized StageWeightsRequest carrying the bucket inline (slice checksums must be set).
    The bytes of slice i are `slice_data[i]` when given (contiguous buffers, e.g. the sender's own
    chunk memory), else payload[byte_start : byte_start + nbytes]; either way they are copied
    once, by the final join."""
    head = inference_pb2.StageWeightsRequest(
        version=version,
        bucket_count=bucket.count,
        bucket_index=bucket.index,
        model_config_json=model_config_json,
        deployment=deployment,
        rank=rank,
        total_bytes=total_bytes,
        commit_when_complete=commit_when_complete,
        adapter=adapter,
    ).SerializeToString()
    parts: list[bytes | memoryview] = [head]
    for i, s in enumerate(bucket.slices):
        meta = s.to_proto().SerializeToString()
        data_head = _DATA + _varint(s.nbytes)
        body_len = len(meta) + len(data_head) + s.nbytes
        parts += [
            _SLICES,
            _varint(body_len),
            meta,
            data_head,
            payload[s.byte_start : s.byte_start + s.nbytes] if slice_data is None else slice_data[i],
        ]
    return b"".join(parts)


# ------------------------------------------------------------------------------ receiving side
class DecodedSlice:
    """A WeightSlice (or ShardChunk) whose `data` is a memoryview into the received message (no
    copy); every other field is read from `meta`, the message parsed by protobuf without the payload."""

    __slots__ = ("data", "meta")

    def __init__(self, meta: inference_pb2.WeightSlice, data: memoryview | bytes) -> None:
        self.meta = meta
        self.data = data

    def __getattr__(self, name: str):
        return getattr(self.meta, name)


# A slice of a StageWeightsRequest as the receiver reads it: parsed, or decoded in place.
SliceLike = inference_pb2.WeightSlice | DecodedSlice


class DecodedStageRequest:
    """A StageWeightsRequest decoded by `decode_stage_request`: header fields from `head`."""

    __slots__ = ("head", "raw", "slices")

    def __init__(
        self, head: inference_pb2.StageWeightsRequest, slices: list[DecodedSlice], raw: bytes
    ) -> None:
        self.head = head
        self.slices = slices
        self.raw = raw  # the message as received (forwarding it to another rank needs no re-encoding)

    def __getattr__(self, name: str):
        return getattr(self.head, name)

    def SerializeToString(self) -> bytes:
        return self.raw


def _varint_at(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Malformed("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


class _Malformed(ValueError):
    pass


def _fields(buf: bytes, start: int, end: int):
    """(field number, wire type, value start, value end) of each field in buf[start:end]."""
    pos = start
    while pos < end:
        key_start = pos
        key, pos = _varint_at(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, stop = _varint_at(buf, pos, end)
        elif wire_type == 1:
            stop = pos + 8
        elif wire_type == _LEN:
            length, pos = _varint_at(buf, pos, end)
            stop = pos + length
        elif wire_type == 5:
            stop = pos + 4
        else:
            raise _Malformed(f"unsupported wire type {wire_type}")
        if stop > end or field == 0:
            raise _Malformed("field runs past the end of its message")
        yield field, wire_type, key_start, pos, stop
        pos = stop


def _decode_with_payloads(raw: bytes, head_type, items_field: int, item_type, payload_field: int):
    """(head, [(item meta, payload view)]): the repeated `items_field` messages parsed by protobuf
    without their `payload_field` bytes, which stay memoryviews of raw; the rest is the head."""
    view = memoryview(raw)
    head_parts: list[bytes] = []
    items: list[tuple[Any, memoryview | bytes]] = []
    for field, wire_type, key_start, start, stop in _fields(raw, 0, len(raw)):
        if field != items_field or wire_type != _LEN:
            head_parts.append(raw[key_start:stop])
            continue
        meta_parts: list[bytes] = []
        data: memoryview | bytes = b""
        for f, wt, k0, s0, s1 in _fields(raw, start, stop):
            if f == payload_field and wt == _LEN:
                data = view[s0:s1]
            else:
                meta_parts.append(raw[k0:s1])
        items.append((item_type.FromString(b"".join(meta_parts)), data))
    return head_type.FromString(b"".join(head_parts)), items


def decode_stage_request(raw: bytes) -> DecodedStageRequest:
    """Decode StageWeightsRequest bytes with slice payloads left in place (memoryviews of raw).

    Protobuf would copy every payload on parse and again on each access of `data`; here only
    the small header and slice metadata go through protobuf (so every field, present or future,
    is parsed by it), and the payload bytes are never copied until the stager copies them into
    their staging tensors. Malformed bytes raise InvalidWeights (INVALID_ARGUMENT)."""
    from .errors import InvalidWeights

    try:
        head, items = _decode_with_payloads(
            raw, inference_pb2.StageWeightsRequest, 2, inference_pb2.WeightSlice, 5
        )
    except Exception as exc:
        raise InvalidWeights(f"StageWeightsRequest: malformed message ({exc})") from None
    return DecodedStageRequest(head, [DecodedSlice(meta, data) for meta, data in items], raw)


class DecodedPushRequest:
    """A PushShardsRequest whose chunks' `data` are memoryviews into the received message."""

    __slots__ = ("head", "shards")

    def __init__(self, head, shards: list[DecodedSlice]) -> None:
        self.head = head
        self.shards = shards

    def __getattr__(self, name: str):
        return getattr(self.head, name)


def decode_push_request(raw: bytes) -> DecodedPushRequest:
    """Decode PushShardsRequest bytes (weight-sync's receiving end of a trainer push) with every
    chunk's bytes left in place: weight-sync copies each once, into shared memory, hashing it on the
    way. Malformed bytes raise InvalidArgument."""
    from looprl.weightsync.v1 import weightsync_pb2
    from services.kit.rpc.errors import InvalidArgument

    try:
        head, items = _decode_with_payloads(
            raw, weightsync_pb2.PushShardsRequest, 4, weightsync_pb2.ShardChunk, 6
        )
    except Exception as exc:
        raise InvalidArgument(f"PushShardsRequest: malformed message ({exc})") from None
    return DecodedPushRequest(head, [DecodedSlice(meta, data) for meta, data in items])
