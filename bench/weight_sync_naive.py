"""The naive weight-update paths the weight-sync bench compares the planned path with.

`naive_full` is the path the issue names and other frameworks run: rank 0 gathers the full state
dict from the trainer's FSDP chunks, then sends every full Hugging Face tensor, one per unary gRPC
call, to every rank of the deployment (one call per tensor and rank; the calls of one tensor go to
the ranks concurrently, each message serialized once, by protobuf). Each receiver rank keeps only its part of
every tensor on arrival, as vLLM's `load_weights` does (every TP rank is handed the full HF tensor
and narrows it to its shard): the pieces come from `services.modeling.layouts.rank_params` at
runtime, so the slicing follows whatever the layouts say, and land in the engine's own
WeightStager (`stage_tensor`) before the ordinary CommitWeights. A tp=2 deployment is sent the
full model once per rank. No checksums on this path (the frameworks it stands for have none), so
the baseline does not pay for verification the planned path does.

With `lean=True` (a printed reference) the same calls use the kit's zero-copy wire codec
(services/weights/wire.py) the planned path uses, instead of plain protobuf.

`naive_resharded` (a printed reference, not a figure): rank 0 gathers the full state dict, then
builds each target rank's tensors itself and sends each rank only its own slices, one tensor per
call: half of the planning done by hand.

`add_bench_handlers` registers the receiver side in the bench's receiver process (method
"/bench.Naive/Load", "/bench.Naive/LoadLean") and "/bench.Naive/Digest", which hashes the tensors of the last committed
version of a rank, so the bench can check that every path ends with byte-identical weights.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Sequence

import grpc
import torch

from looprl.inference.v1 import inference_pb2
from services.kit.messages.codec import PROTO_TO_TORCH, TORCH_TO_PROTO, tensor_from_bytes, tensor_to_bytes
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, Piece, rank_params
from services.weight_sync.transport import Endpoint, GrpcTransport
from services.weights import BytesBucket, SliceRef, WeightOnlyEngine, hash64
from services.weights.wire import DecodedStageRequest, decode_stage_request, encode_stage_request

LOAD = "/bench.Naive/Load"
LOAD_LEAN = "/bench.Naive/LoadLean"
DIGEST = "/bench.Naive/Digest"


def _identity(x: bytes) -> bytes:
    return x


def _flat_runs(piece: Piece, shape: Sequence[int]):
    """(element offset into the flattened target, source index) for each contiguous run of the
    piece's target box: one run when only dim 0 is partial (every layout so far), else one per
    index of the dims before the last partial one."""
    tbox, sbox = piece.target_box, piece.source_box
    partial = [d for d, (a, b) in enumerate(tbox) if (a, b) != (0, shape[d])]
    last = partial[-1] if partial else 0
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    for idx in itertools.product(*(range(a, b) for a, b in tbox[:last])):
        offset = sum(i * s for i, s in zip(idx, strides[:last], strict=True)) + tbox[last][0] * strides[last]
        source = tuple(sbox[k][0] + i - tbox[k][0] for k, i in enumerate(idx))
        yield offset, (*source, *(slice(a, b) for a, b in sbox[last:]))


class NaiveLoader:
    """Receiver side of `naive_full` for one rank: full HF tensor in, this rank's slices staged."""

    def __init__(self, engine: WeightOnlyEngine, config: ModelConfig, layout: Layout, rank: int) -> None:
        self.engine = engine
        self.by_source: dict[str, list[tuple[str, int, tuple]]] = {}
        for param in rank_params(config, layout, rank):
            for piece in param.pieces:
                for offset, index in _flat_runs(piece, param.shape):
                    self.by_source.setdefault(piece.source, []).append((param.name, offset, index))
        self.last_committed: dict[str, torch.Tensor] = {}
        swap = engine.receiver.on_commit

        def on_commit(version: int, state: dict[str, torch.Tensor]):
            self.last_committed = state  # kept for Digest; recycled buffers stay intact until next staging
            return swap(version, state)

        engine.receiver.on_commit = on_commit

    async def load(self, request: inference_pb2.StageWeightsRequest | DecodedStageRequest, context) -> bytes:
        # Off the event loop, as WeightReceiver stages: the ranks of this process copy in parallel.
        await asyncio.to_thread(self._stage, request)
        return b""

    def _stage(self, request: inference_pb2.StageWeightsRequest | DecodedStageRequest) -> None:
        (sl,) = request.slices
        full = tensor_from_bytes(sl.data, PROTO_TO_TORCH[sl.dtype], tuple(sl.shape))
        stager = self.engine.stager
        for name, offset, index in self.by_source.get(sl.name, ()):
            stager.stage_tensor(int(request.version), name, offset, full[index])

    async def digest(self, request: bytes, context) -> bytes:
        sums = {
            n: hash64(t.contiguous().view(-1).view(torch.uint8).numpy())
            for n, t in self.last_committed.items()
        }
        return json.dumps(sums, sort_keys=True).encode()


def add_bench_handlers(server: grpc.aio.Server, loader: NaiveLoader) -> None:
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Naive",
                {
                    "Load": grpc.unary_unary_rpc_method_handler(
                        loader.load,
                        request_deserializer=inference_pb2.StageWeightsRequest.FromString,
                        response_serializer=_identity,
                    ),
                    "LoadLean": grpc.unary_unary_rpc_method_handler(
                        loader.load, request_deserializer=decode_stage_request, response_serializer=_identity
                    ),
                    "Digest": grpc.unary_unary_rpc_method_handler(
                        loader.digest, request_deserializer=_identity, response_serializer=_identity
                    ),
                },
            ),
        )
    )


def gather(buf) -> dict[str, torch.Tensor]:
    """Rank 0's full state dict: every parameter's FSDP chunks concatenated (dim 0) in one tensor."""
    full = {}
    for name, (shape, _dtype) in buf.params.items():
        parts = sorted((k[2], t) for k, t in buf.chunks.items() if k[0] == name)
        full[name] = torch.cat([t for _, t in parts]).view(shape)
    return full


async def naive_full(
    transport: GrpcTransport, buf, endpoints: Sequence[Endpoint], version: int, *, lean: bool = False
) -> int:
    """Gather on rank 0, then every full HF tensor in its own call to every rank; bytes sent.

    Messages are built and parsed by protobuf (the figure's baseline: what a naive implementation
    writes), or with `lean`, with the kit's zero-copy wire codec the planned path uses (a printed
    reference: how much of the gap is the codec rather than the plan)."""
    full = gather(buf)
    calls = [
        transport.channel(ep.address).unary_unary(
            LOAD_LEAN if lean else LOAD, request_serializer=_identity, response_deserializer=_identity
        )
        for ep in endpoints
    ]
    sent = 0
    for name, tensor in full.items():
        if lean:
            raw = tensor.view(-1).view(torch.uint8).numpy()
            meta = SliceRef(name, TORCH_TO_PROTO[tensor.dtype], tuple(tensor.shape), 0, 0, raw.nbytes)
            message = encode_stage_request(BytesBucket(0, 1, [meta], raw), memoryview(raw), version=version)
        else:
            tensor_slice = inference_pb2.WeightSlice(
                name=name,
                dtype=TORCH_TO_PROTO[tensor.dtype],
                shape=tensor.shape,
                data=tensor_to_bytes(tensor),
            )
            message = inference_pb2.StageWeightsRequest(
                version=version, slices=[tensor_slice]
            ).SerializeToString()
        await asyncio.gather(*(call(message) for call in calls))
        sent += tensor.numel() * tensor.element_size() * len(calls)
    del full
    await asyncio.gather(*(transport.commit(ep, version) for ep in endpoints))
    return sent


async def naive_resharded(
    transport: GrpcTransport,
    config: ModelConfig,
    layout: Layout,
    buf,
    endpoints: Sequence[Endpoint],
    version: int,
) -> int:
    """Gather on rank 0, build each target rank's tensors there, one tensor per call to its rank."""
    from services.weights import tensors_bucket
    from services.weights.specs import proto_dtype

    full = gather(buf)
    sent = 0
    for ep in endpoints:
        stub = transport.stub(ep.address)
        for p in rank_params(config, layout, ep.rank):
            t = torch.empty(p.shape, dtype=layout.torch_dtype)
            for piece in p.pieces:
                t[piece.target_index()] = full[piece.source][piece.source_index()]
            b = tensors_bucket(0, 1, {p.name: t}, proto_dtype(layout.torch_dtype))
            req = inference_pb2.StageWeightsRequest(
                version=version, rank=ep.rank, slices=[s.to_proto(data=bytes(b.payload)) for s in b.slices]
            )
            await stub.StageWeights(iter([req]))
            sent += b.nbytes
        await transport.commit(ep, version)
    del full
    return sent


async def digests(transport: GrpcTransport, endpoints: Sequence[Endpoint]) -> dict[int, dict[str, int]]:
    """hash64 of every tensor each rank committed last, by rank."""
    out = {}
    for ep in endpoints:
        call = transport.channel(ep.address).unary_unary(
            DIGEST, request_serializer=_identity, response_deserializer=_identity
        )
        out[ep.rank] = json.loads(await call(b""))
    return out
