"""GPU weight transports behind the same Transport interface: CUDA IPC and NCCL broadcast.

- CudaIpcTransport (sender and receivers on one GPU host): each bucket is assembled once in
  pinned host memory, copied once to a device buffer, and every receiver gets its CUDA IPC handle
  in StageWeightsRequest.device_handle; receivers copy their slices device-to-device.
- NcclBroadcastTransport (across hosts on a GPU fabric): weight-sync is rank 0 of a NCCL group
  with the receivers; the control message (slices, nccl_broadcast=True) goes over gRPC and the
  bucket bytes follow as one broadcast into each receiver's device buffer.

Receivers call `stage_device_request(stager, request, nccl=None)` from their StageWeights
handler (WeightReceiver does it automatically when the request carries a handle or announces a
broadcast). Checksums are verified on the host copy of each slice when `verify=True` (a device
hash would avoid that copy; not implemented). Only exercised on CUDA machines (gpu-marked test).
"""

from __future__ import annotations

import asyncio
import pickle
import time
import zlib

import torch

from looprl.inference.v1 import inference_pb2

from .checksum import hash64
from .errors import ChecksumMismatch, InvalidWeights
from .specs import torch_dtype_of
from .stager import StageProgress, WeightStager
from .transport_base import Endpoint, StageResult, Transport, aiter_buckets


def _device_bucket(bucket, device: torch.device) -> torch.Tensor:
    host = torch.empty(bucket.nbytes, dtype=torch.uint8, pin_memory=True)
    bucket.fill(memoryview(host.numpy()))
    return host.to(device, non_blocking=True)


class CudaIpcTransport(Transport):
    name = "cuda_ipc"

    def __init__(self, device: str | torch.device = "cuda", **kw) -> None:
        super().__init__(**kw)
        self.device = torch.device(device)

    async def stage(
        self, version, endpoints, buckets, *, model_config_json="", total_bytes=0, timeout_s=600.0
    ):
        from torch.multiprocessing.reductions import reduce_tensor

        results = {ep: StageResult(ep) for ep in endpoints}
        start = time.perf_counter()
        first = True
        async for bucket in aiter_buckets(buckets):
            dev = await asyncio.to_thread(_device_bucket, bucket, self.device)
            torch.cuda.current_stream(self.device).synchronize()
            handle = pickle.dumps(reduce_tensor(dev))
            req = inference_pb2.StageWeightsRequest(
                version=version, bucket_count=bucket.count, bucket_index=bucket.index, total_bytes=total_bytes,
                model_config_json=model_config_json if first else "", device_handle=handle,
                slices=[s.to_proto(shm_name="") for s in bucket.slices],
            )  # fmt: skip
            for sl, ref in zip(req.slices, bucket.slices, strict=True):
                sl.shm_offset = ref.byte_start
            first = False
            await _send_all(self, results, req, timeout_s, bucket.nbytes)
            del dev  # receivers answered: they copied out of it
        _finish(results, start, version)
        await asyncio.gather(*(self.abort(ep, version) for ep, r in results.items() if r.error is not None))
        return results


class NcclBroadcastTransport(Transport):
    """Rank 0 of `group` (torch.distributed, NCCL) broadcasting buckets to receiver ranks."""

    name = "nccl"

    def __init__(self, group, device: str | torch.device = "cuda", **kw) -> None:
        super().__init__(**kw)
        self.group = group
        self.device = torch.device(device)

    async def stage(
        self, version, endpoints, buckets, *, model_config_json="", total_bytes=0, timeout_s=600.0
    ):
        import torch.distributed as dist

        results = {ep: StageResult(ep) for ep in endpoints}
        start = time.perf_counter()
        async for bucket in aiter_buckets(buckets):
            dev = await asyncio.to_thread(_device_bucket, bucket, self.device)
            req = inference_pb2.StageWeightsRequest(
                version=version, bucket_count=bucket.count, bucket_index=bucket.index, total_bytes=total_bytes,
                nccl_broadcast=True, slices=[s.to_proto() for s in bucket.slices],
            )  # fmt: skip
            for sl, ref in zip(req.slices, bucket.slices, strict=True):
                sl.shm_offset = ref.byte_start
            # Receivers enter the broadcast inside their StageWeights handler; the call returns after it.
            send = asyncio.create_task(_send_all(self, results, req, timeout_s, bucket.nbytes))
            await asyncio.to_thread(dist.broadcast, dev, 0, self.group)
            await send
        _finish(results, start, version)
        return results


def stage_device_request(
    stager: WeightStager, request: inference_pb2.StageWeightsRequest, *, nccl_group=None,
    device: str | torch.device = "cuda", verify: bool = True,
) -> StageProgress:  # fmt: skip
    """Receiver side of both GPU transports."""
    total = max((s.shm_offset + s.nbytes for s in request.slices), default=0)
    if request.device_handle:
        fn, args = pickle.loads(request.device_handle)
        buf = fn(*args)
    elif request.nccl_broadcast:
        import torch.distributed as dist

        if nccl_group is None:
            raise InvalidWeights("nccl_broadcast: this receiver has no NCCL weight group")
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        dist.broadcast(buf, 0, nccl_group)
    else:
        raise InvalidWeights("StageWeightsRequest carries neither device_handle nor nccl_broadcast")
    progress = None
    for i, sl in enumerate(request.slices):
        dtype = torch_dtype_of(sl.dtype)
        if dtype is None:
            raise InvalidWeights(f"slices[{i}].dtype: unsupported enum {sl.dtype}")
        raw = buf[sl.shm_offset : sl.shm_offset + sl.nbytes]
        if verify and sl.HasField("hash64"):
            actual = hash64(raw.cpu().numpy())
            if actual != sl.hash64:
                stager.abort(request.version)
                raise ChecksumMismatch(
                    f"slices[{i}].hash64: {sl.name} has hash64 {actual:#018x}, sender said {sl.hash64:#018x}"
                )
        elif verify:
            actual = zlib.crc32(raw.cpu().numpy())
            if actual != sl.crc32:
                stager.abort(request.version)
                raise ChecksumMismatch(
                    f"slices[{i}].crc32: {sl.name} has crc32 {actual:#010x}, sender said {sl.crc32:#010x}"
                )
        progress = stager.stage_tensor(request.version, sl.name, int(sl.offset), raw.view(dtype))
    torch.cuda.synchronize()
    return progress or StageProgress(
        request.version, stager.bytes_staged, stager.is_complete(request.version)
    )


async def _send_all(transport: Transport, results, req, timeout_s, nbytes) -> None:
    async def one(ep: Endpoint) -> None:
        res = results[ep]
        if res.error is not None:
            return
        r = inference_pb2.StageWeightsRequest()
        r.CopyFrom(req)
        r.rank = ep.rank
        try:
            resp = await transport.stub(ep.address).StageWeights(iter([r]), timeout=timeout_s)
            res.bytes_sent += nbytes
            res.buckets += 1
            res.complete = resp.complete
        except BaseException as exc:
            res.error = transport._error(ep, exc)

    await asyncio.gather(*(one(ep) for ep in results))


def _finish(results, start, version) -> None:
    from .errors import DeliveryError

    for ep, res in results.items():
        res.seconds = time.perf_counter() - start
        if res.error is None and not res.complete:
            res.error = DeliveryError(
                f"{ep}: version {version} incomplete after last bucket", endpoint=str(ep)
            )
