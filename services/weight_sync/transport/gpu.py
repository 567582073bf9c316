"""GPU weight transports behind the same Transport interface: CUDA IPC and NCCL broadcast.

- CudaIpcTransport (sender and receivers on one GPU host): each bucket is assembled once in
  pinned host memory, copied once to a device buffer, and every receiver gets its CUDA IPC handle
  in StageWeightsRequest.device_handle; receivers copy their slices device-to-device.
- NcclBroadcastTransport (across hosts on a GPU fabric): weight-sync is rank 0 of a NCCL group
  with the receivers; the control message (slices, nccl_broadcast=True) goes over gRPC and the
  bucket bytes follow as one broadcast into each receiver's device buffer.

The receiving side is services/weights/device.py (WeightReceiver hands it every request that
carries a handle or announces a broadcast). Only exercised on CUDA machines (gpu-marked test);
the factory (factory.py) refuses both on a host without CUDA.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import torch

from looprl.inference.v1 import inference_pb2
from services.weights.errors import DeliveryError

from .base import Delivery, Endpoint, StageResult, Transport, aiter_buckets


def _device_bucket(bucket, device: torch.device) -> torch.Tensor:
    host = torch.empty(bucket.nbytes, dtype=torch.uint8, pin_memory=True)
    bucket.fill(host.numpy().data)
    return host.to(device, non_blocking=True)


class DeviceTransport(Transport):
    """What both device transports share: each bucket is assembled once in pinned host memory and
    copied to a device buffer; every receiver gets a control message over gRPC naming its slices by
    byte offset in that buffer, and the subclass hands the buffer over (`_hand_over`)."""

    def __init__(self, device: str | torch.device = "cuda", **kw) -> None:
        super().__init__(**kw)
        self.device = torch.device(device)

    async def stage(self, delivery: Delivery, endpoints: Sequence[Endpoint]) -> dict[Endpoint, StageResult]:
        results = {ep: StageResult(ep) for ep in endpoints}
        start = time.perf_counter()
        first = True
        async for bucket in aiter_buckets(delivery.buckets):
            dev = await asyncio.to_thread(_device_bucket, bucket, self.device)
            req = delivery.request(
                bucket,
                [s.to_proto() for s in bucket.slices],
                model_config_json=delivery.model_config_json if first else "",
            )
            for sl, ref in zip(req.slices, bucket.slices, strict=True):
                sl.shm_offset = ref.byte_start
            first = False
            await self._hand_over(dev, req, _send_all(self, results, req, delivery.timeout_s, bucket.nbytes))
            del dev  # receivers answered: they copied out of it
        _finish(results, start, delivery.version)
        await asyncio.gather(
            *(self.abort(ep, delivery.version) for ep, r in results.items() if r.error is not None)
        )
        return results

    async def _hand_over(
        self, dev: torch.Tensor, req: inference_pb2.StageWeightsRequest, send: Coroutine[Any, Any, None]
    ) -> None:
        """Make `dev` reachable by the receivers of `req` and run `send` (the control messages)."""
        raise NotImplementedError


class CudaIpcTransport(DeviceTransport):
    """Receivers on this GPU host map the bucket's device buffer through its CUDA IPC handle."""

    name = "cuda_ipc"

    async def _hand_over(
        self, dev: torch.Tensor, req: inference_pb2.StageWeightsRequest, send: Coroutine[Any, Any, None]
    ) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.current_stream(self.device).synchronize()
        req.device_handle = pickle.dumps(reduce_tensor(dev))
        await send


class NcclBroadcastTransport(DeviceTransport):
    """Rank 0 of `group` (torch.distributed, NCCL) broadcasting buckets to receiver ranks."""

    name = "nccl"

    def __init__(self, group: Any, device: str | torch.device = "cuda", **kw) -> None:
        super().__init__(device, **kw)
        self.group = group

    async def _hand_over(
        self, dev: torch.Tensor, req: inference_pb2.StageWeightsRequest, send: Coroutine[Any, Any, None]
    ) -> None:
        import torch.distributed as dist

        req.nccl_broadcast = True
        # Receivers enter the broadcast inside their StageWeights handler; the call returns after it.
        sending = asyncio.create_task(send)
        await asyncio.to_thread(dist.broadcast, dev, 0, self.group)
        await sending


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
            res.answered(resp)
        except BaseException as exc:
            res.error = transport._error(ep, exc)

    await asyncio.gather(*(one(ep) for ep in results))


def _finish(results, start, version) -> None:
    for ep, res in results.items():
        res.seconds = time.perf_counter() - start
        if res.error is None and not res.complete:
            res.error = DeliveryError(
                f"{ep}: version {version} incomplete after last bucket", endpoint=str(ep)
            )
