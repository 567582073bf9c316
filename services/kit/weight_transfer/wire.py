"""StageWeightsRequest on the wire, built without protobuf copying the payload.

Protobuf's Python API would copy each slice's bytes into the message and again when it
serializes. A bucket is instead encoded by hand: small headers serialized by protobuf, the
payload spliced in as memoryviews, one join. Parsers accept fields in any order, so the
result is a valid StageWeightsRequest for any receiver (tests check it round-trips).
"""

from __future__ import annotations

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
) -> bytes:
    """Serialized StageWeightsRequest carrying the bucket inline (slice checksums must be set)."""
    head = inference_pb2.StageWeightsRequest(
        version=version,
        bucket_count=bucket.count,
        bucket_index=bucket.index,
        model_config_json=model_config_json,
        deployment=deployment,
        rank=rank,
        total_bytes=total_bytes,
    ).SerializeToString()
    parts: list[bytes | memoryview] = [head]
    for s in bucket.slices:
        meta = s.to_proto().SerializeToString()
        data_head = _DATA + _varint(s.nbytes)
        body_len = len(meta) + len(data_head) + s.nbytes
        parts += [
            _SLICES,
            _varint(body_len),
            meta,
            data_head,
            payload[s.byte_start : s.byte_start + s.nbytes],
        ]
    return b"".join(parts)
