"""The receiving side of the GPU transports (CUDA IPC and NCCL broadcast): stage a bucket that
arrives as a device buffer instead of bytes in the message.

WeightReceiver calls `stage_device_request` when a StageWeightsRequest carries a CUDA IPC handle or
announces a broadcast; the senders are services/weight_sync/transport/gpu.py. Only exercised on
CUDA machines (gpu-marked test).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import torch

from looprl.inference.v1 import inference_pb2

from .checksum import SliceChecksum, verify_slice
from .errors import InvalidWeights, WeightTransferError
from .specs import torch_dtype_of
from .stager import StageProgress, WeightStager
from .wire import DecodedStageRequest, SliceLike


def stage_device_request(
    stager: WeightStager,
    request: inference_pb2.StageWeightsRequest | DecodedStageRequest,
    *,
    nccl_group=None,
    device: str | torch.device = "cuda",
    verify: bool = True,
) -> StageProgress:
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
    slices: Sequence[SliceLike] = request.slices
    for i, sl in enumerate(slices):
        dtype = torch_dtype_of(sl.dtype)
        if dtype is None:
            raise InvalidWeights(f"slices[{i}].dtype: unsupported enum {sl.dtype}")
        raw = buf[sl.shm_offset : sl.shm_offset + sl.nbytes]
        if verify:  # on a host copy of the slice: no device hash yet
            try:
                verify_slice(
                    SliceChecksum.of(sl), raw.cpu().numpy(), where=f"slices[{i}]", what=f"{sl.name} bytes"
                )
            except WeightTransferError:
                stager.abort(request.version)
                raise
        progress = stager.stage_tensor(request.version, sl.name, int(sl.offset), raw.view(dtype))
    torch.cuda.synchronize()
    return progress or StageProgress(
        request.version, stager.bytes_staged, stager.is_complete(request.version)
    )
