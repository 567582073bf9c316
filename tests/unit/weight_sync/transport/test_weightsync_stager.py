"""WeightStager: the receiver's checks. Bad slices are rejected with a clear error and nothing is
ever swapped; only a complete, verified version commits."""

from __future__ import annotations

import itertools

import grpc
import pytest
import torch

from looprl.common.v1 import common_pb2
from looprl.inference.v1 import inference_pb2
from services.weight_sync.transport.arena import ShmPool
from services.weights import (
    ChecksumMismatch,
    IncompleteVersion,
    InvalidWeights,
    StaleVersion,
    WeightStager,
    tensors_bucket,
)
from services.weights.checksum import hash64

F32 = common_pb2.DType.D_TYPE_FLOAT32


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g)}


def request(version, tensors, rank=0):
    bucket = tensors_bucket(0, 1, tensors, F32)
    payload = bytes(bucket.payload)
    return inference_pb2.StageWeightsRequest(
        version=version,
        rank=rank,
        slices=[s.to_proto(data=payload[s.byte_start : s.byte_start + s.nbytes]) for s in bucket.slices],
    )


def one_slice(name="a.weight", shape=(4, 3), offset=0, data=None, dtype=F32, checksum=None, sums=True):
    data = data if data is not None else torch.ones(3).numpy().tobytes()
    req = inference_pb2.StageWeightsRequest(
        version=1,
        slices=[
            inference_pb2.WeightSlice(
                name=name,
                dtype=dtype,
                shape=shape,
                offset=offset,
                data=data,
            )
        ],
    )
    if sums:
        req.slices[0].hash64 = hash64(data) if checksum is None else checksum
    return req


def test_complete_version_commits_and_becomes_serving():
    stager = WeightStager(weights())
    w = weights(1)
    progress = stager.stage(request(1, w))
    assert progress.complete and progress.bytes_received == stager.total_bytes
    state = stager.commit(1)
    assert all(torch.equal(state[n], w[n]) for n in w)
    assert stager.serving_version == 1 and stager.staged_version is None


def test_buckets_across_calls_and_in_any_order():
    stager = WeightStager(weights())
    w = weights(2)
    assert not stager.stage(request(3, {"b.bias": w["b.bias"]})).complete
    with pytest.raises(IncompleteVersion, match=r"a\.weight"):
        stager.commit(3)
    assert stager.stage(request(3, {"a.weight": w["a.weight"]})).complete
    assert torch.equal(stager.commit(3)["a.weight"], w["a.weight"])


@pytest.mark.parametrize(
    "bad,error,field",
    [
        (one_slice(name="nope.weight"), InvalidWeights, "slices[0].name"),
        (one_slice(shape=(3, 4)), InvalidWeights, "slices[0].shape"),
        (one_slice(dtype=common_pb2.DType.D_TYPE_BFLOAT16), InvalidWeights, "slices[0].dtype"),
        (one_slice(offset=11), InvalidWeights, "slices[0].offset"),
        (one_slice(offset=-1), InvalidWeights, "slices[0].offset"),
        (one_slice(data=b"\x00" * 7), InvalidWeights, "slices[0].data"),
        (one_slice(checksum=12345), ChecksumMismatch, "slices[0].hash64"),
        (one_slice(sums=False), InvalidWeights, "slices[0].hash64"),
    ],
)
def test_bad_slices_are_rejected_and_drop_the_staged_version(bad, error, field):
    stager = WeightStager(weights())
    stager.stage(request(1, {"b.bias": weights()["b.bias"]}))
    with pytest.raises(error) as info:
        stager.stage(bad)
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)
    assert stager.staged_version is None and stager.serving_version == -1
    with pytest.raises(IncompleteVersion):
        stager.commit(1)


def test_error_classes_carry_grpc_status_codes():
    assert InvalidWeights.code == grpc.StatusCode.INVALID_ARGUMENT
    assert StaleVersion.code == grpc.StatusCode.FAILED_PRECONDITION
    assert ChecksumMismatch.code == grpc.StatusCode.DATA_LOSS


def test_versions_must_move_forward():
    stager = WeightStager(weights())
    stager.stage(request(2, weights()))
    stager.commit(2)
    with pytest.raises(StaleVersion, match="not newer than the serving version 2"):
        stager.stage(request(2, weights()))
    stager.stage(request(4, {"b.bias": weights()["b.bias"]}))
    with pytest.raises(StaleVersion, match="older than the staged version 4"):
        stager.stage(request(3, weights()))
    assert stager.staged_version == 4  # a stale request does not disturb the staged version
    stager.stage(request(5, weights()))  # newer supersedes the unfinished 4
    assert stager.is_complete(5)


def test_overlapping_ranges_are_rejected():
    stager = WeightStager(weights())
    stager.stage(one_slice(offset=0))
    with pytest.raises(InvalidWeights, match="already staged"):
        stager.stage(one_slice(offset=2))


def test_wrong_rank_is_rejected():
    stager = WeightStager(weights(), rank=1)
    with pytest.raises(InvalidWeights, match="rank"):
        stager.stage(request(1, weights(), rank=0))


def test_abort_keeps_serving_weights_and_buffers_are_reused():
    stager = WeightStager(weights())
    stager.stage(request(1, weights(1)))
    first = stager.commit(1)
    stager.give_back(first)
    stager.stage(request(2, {"b.bias": weights(2)["b.bias"]}))
    assert stager.abort(2)
    assert stager.serving_version == 1 and stager.staged_version is None
    assert not stager.abort(2)


def test_slices_from_shared_memory():
    stager = WeightStager(weights())
    w = weights(3)
    bucket = tensors_bucket(0, 1, w, F32)
    pool = ShmPool(1 << 16, count=1)
    try:
        seg = pool.acquire(bucket.nbytes)
        bucket.fill(seg.buffer[: bucket.nbytes])
        req = inference_pb2.StageWeightsRequest(
            version=1, slices=[s.to_proto(shm_name=seg.name) for s in bucket.slices]
        )
        assert stager.stage(req).complete
        assert torch.equal(stager.commit(1)["a.weight"], w["a.weight"])
        bad = inference_pb2.StageWeightsRequest(
            version=2,
            slices=[inference_pb2.WeightSlice(name="a.weight", shm_name="../../etc/passwd", nbytes=4)],
        )
        with pytest.raises(InvalidWeights, match="shm_name"):
            stager.stage(bad)
    finally:
        pool.close()


def _adopt_request(version, seg_name, placed, split_at=None, sums=True):
    """Slices naming whole parameters already laid out in a segment (a shared copy)."""
    from services.weights.checksum import sum64

    slices = []
    for name, (offset, t) in placed.items():
        raw = t.reshape(-1).numpy().view("uint8")
        cuts = [0, t.numel()] if split_at is None else [0, split_at, t.numel()]
        for lo, hi in itertools.pairwise(cuts):
            sl = inference_pb2.WeightSlice(
                name=name,
                dtype=F32,
                shape=t.shape,
                offset=lo,
                nbytes=(hi - lo) * 4,
                shm_name=seg_name,
                shm_offset=offset + lo * 4,
                shm_adopt=True,
            )
            if sums:
                sl.sum64 = sum64(raw[lo * 4 : hi * 4])
            slices.append(sl)
    return inference_pb2.StageWeightsRequest(version=version, slices=slices)


def _shared_copy(pool, w):
    seg = pool.acquire(1 << 12)
    placed, at = {}, 0
    for name, t in w.items():
        raw = t.reshape(-1).numpy().view("uint8")
        seg.buffer[at : at + raw.nbytes] = raw.tobytes()
        placed[name] = (at, t)
        at += -(-raw.nbytes // 64) * 64
    return seg, placed


def test_adopted_slices_serve_from_the_shared_copy_read_only_and_never_become_staging_buffers():
    """A shared copy is adopted, not copied: the committed tensors are views of the segment (a
    later write to it shows through), they stay the rollback point, and a version that arrives by
    copy afterwards gets fresh buffers instead of writing into the read-only mapping."""
    stager = WeightStager(weights())
    w = weights(4)
    pool = ShmPool(1 << 12, count=1)
    try:
        seg, placed = _shared_copy(pool, w)
        assert stager.stage(_adopt_request(1, seg.name, placed, split_at=2)).complete
        state = stager.commit(1)
        assert torch.equal(state["a.weight"], w["a.weight"]) and torch.equal(state["b.bias"], w["b.bias"])
        seg.buffer[0:4] = torch.tensor([42.0]).numpy().tobytes()  # the segment's owner rewrites it
        assert state["a.weight"][0, 0].item() == 42.0  # ... and the receiver sees it: no private copy
        stager.give_back({})
        stager.stage(request(2, weights(5)))  # by copy: must not land in the read-only views
        assert torch.equal(stager.commit(2)["b.bias"], weights(5)["b.bias"])
        stager.give_back(state)  # adopted tensors handed back: the rollback point, not buffers
        assert stager.rollback_version == 1
        stager.stage(request(3, weights(6)))
        assert torch.equal(stager.commit(3)["a.weight"], weights(6)["a.weight"])
    finally:
        pool.close()


def test_adopted_slices_are_checked_and_a_wrong_share_is_caught():
    stager = WeightStager(weights())
    w = weights(7)
    pool = ShmPool(1 << 12, count=1)
    try:
        seg, placed = _shared_copy(pool, w)
        bad_sum = _adopt_request(1, seg.name, placed)
        bad_sum.slices[1].sum64 ^= 1
        with pytest.raises(ChecksumMismatch, match=r"slices\[1\]\.sum64: b\.bias .* in shared copy"):
            stager.stage(bad_sum)
        assert stager.staged_version is None
        misaligned = _adopt_request(1, seg.name, placed)
        misaligned.slices[0].shm_offset += 2
        with pytest.raises(
            InvalidWeights, match=r"slices\[0\]\.shm_offset: a\.weight .* not a float32 boundary"
        ):
            stager.stage(misaligned)
        split = _adopt_request(1, seg.name, placed, split_at=2)
        split.slices[1].shm_offset += 64  # the second half claims the parameter lies elsewhere
        with pytest.raises(InvalidWeights, match=r"slices\[1\]\.shm_offset: a\.weight lies at"):
            stager.stage(split)
        mixed = _adopt_request(1, seg.name, {"a.weight": placed["a.weight"]}, split_at=2)
        del mixed.slices[1]
        stager.stage(mixed)  # the first half adopted...
        with pytest.raises(InvalidWeights, match="mixes copied and adopted"):
            stager.stage(one_slice(offset=6))  # ... the rest by copy would write into shared memory
        assert stager.staged_version is None
        # Unverified shares (no sum64) are accepted: a peer sharing the copy verifies them.
        assert stager.stage(_adopt_request(1, seg.name, placed, sums=False)).complete
    finally:
        pool.close()


def test_a_device_stager_copies_adopted_slices_and_checks_only_its_share():
    """A GPU engine cannot serve from host shared memory: it copies adopted slices to its device,
    verifying those that carry a sum64 and trusting the peers' share (device 'meta' stands in)."""
    stager = WeightStager(weights(), device="meta")
    w = weights(8)
    pool = ShmPool(1 << 12, count=1)
    try:
        seg, placed = _shared_copy(pool, w)
        req = _adopt_request(1, seg.name, placed, split_at=2)
        req.slices[0].ClearField("sum64")  # a peer's share
        assert stager.stage(req).complete
        assert stager.commit(1)["a.weight"].device.type == "meta"
        bad = _adopt_request(2, seg.name, placed)
        bad.slices[0].sum64 ^= 1
        with pytest.raises(ChecksumMismatch, match=r"slices\[0\]\.sum64"):
            stager.stage(bad)
    finally:
        pool.close()


def test_rollback_returns_the_version_served_before():
    stager = WeightStager(weights())
    stager.stage(request(1, weights(1)))
    v1 = stager.commit(1)
    stager.give_back({})  # nothing served before version 1: no rollback point
    assert stager.rollback_version is None
    stager.stage(request(2, weights(2)))
    v2 = stager.commit(2)
    stager.give_back(v1)  # the replica retired version 1's tensors
    assert stager.rollback_version == 1
    previous, state = stager.rollback(2)
    assert previous == 1 and stager.serving_version == 1
    assert all(torch.equal(state[n], weights(1)[n]) for n in state)
    stager.recycle(v2)
    with pytest.raises(IncompleteVersion, match="cannot roll back"):
        stager.rollback(1)  # nothing before 1 is held
    # Version 2 was rejected; 3 stages and commits normally.
    stager.stage(request(3, weights(3)))
    assert torch.equal(stager.commit(3)["a.weight"], weights(3)["a.weight"])


def test_staging_a_newer_version_consumes_the_rollback_point():
    stager = WeightStager(weights())
    stager.stage(request(1, weights(1)))
    v1 = stager.commit(1)
    stager.stage(request(2, weights(2)))
    stager.commit(2)
    stager.give_back(v1)
    stager.stage(request(3, {"b.bias": weights(3)["b.bias"]}))  # reuses version 1's buffers
    assert stager.rollback_version is None
    with pytest.raises(IncompleteVersion, match="no longer held"):
        stager.rollback(2)
    assert stager.serving_version == 2


def test_shm_reader_keeps_mappings_until_their_segment_is_gone():
    from services.weights.shm import ShmReader

    pool = ShmPool(1 << 12, count=1, tag="refresh")
    reader = ShmReader()
    try:
        seg = pool.acquire(16)
        seg.buffer[:4] = b"abcd"
        assert bytes(reader.view(seg.name, 0, 4)) == b"abcd"
        reader.refresh()
        seg.buffer[:4] = b"wxyz"  # the sender reuses the segment: the kept mapping sees the new bytes
        assert bytes(reader.view(seg.name, 0, 4)) == b"wxyz"
        pool.close()  # the segment is unlinked: its mapping must not keep the pages alive
        reader.refresh()
        assert not reader._maps
        with pytest.raises(InvalidWeights, match="does not exist"):
            reader.view(seg.name, 0, 4)
    finally:
        reader.close()
        pool.close()
