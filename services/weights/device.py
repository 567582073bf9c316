"""The receiving side of the GPU transports (CUDA IPC and NCCL broadcast): stage a bucket that
arrives as a device buffer instead of bytes in the message.

WeightReceiver calls `stage_device_request` when a StageWeightsRequest carries a CUDA IPC handle or
announces a broadcast; the senders are services/weight_sync/transport/gpu.py. Only exercised on
CUDA machines (gpu-marked test).
"""

from __future__ import annotations

import pickle
import zlib

import torch

from looprl.inference.v1 import inference_pb2

from .checksum import hash64
from .errors import ChecksumMismatch, InvalidWeights
from .specs import torch_dtype_of
from .stager import StageProgress, WeightStager


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
