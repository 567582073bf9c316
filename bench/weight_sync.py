"""Weight-sync benchmark: planned, bucketed delivery vs the naive path, transports vs their ceilings.

Receivers are real InferenceEngineService gRPC servers (WeightOnlyEngine) in subprocesses on
127.0.0.1; the sender holds a version as the trainer pushed it (2-rank FSDP dim-0 chunks).

Figures:
- planned_over_naive: time of the naive path / time of the planned bucketed gRPC path, both
  updating a tp=2 fused deployment to a new version (value and baseline: model bytes per second
  of each, so value / baseline is that ratio). The naive path is the issue's and what other
  frameworks run (bench/weight_sync_naive.py): gather the full state dict on "rank 0", then send
  every full Hugging Face tensor in its own unary gRPC call to every target rank (so a tp=2
  deployment is sent the model twice), each rank keeping its slice of it on arrival (slices
  derived from services/modeling/layouts.py, as vLLM's load_weights narrows each full tensor).
  Messages are built and parsed by plain protobuf. Printed beside it, not figures: the same naive
  calls with the kit's zero-copy wire codec (what the codec alone is worth), and "naive resharded
  on rank 0", which builds each rank's tensors on rank 0 and sends each rank only its own, still
  one tensor per call. The naive paths verify no checksum; the planned one hashes every slice.
  Every path's committed weights are hashed on every rank and must be identical (the bench fails
  otherwise).
- shm_fraction_of_memcpy: shared-memory path throughput (tp=1 deployment on this host) / raw
  single-thread memcpy bandwidth of the same bytes (the version's trainer chunks, where the path
  reads them, into a destination of the model's size) measured right before and after it (best
  of both, as the paths are best of their runs). A 32 MiB buffer copied over and over (mostly
  in cache, the baseline until now) is printed beside it for reference.
- grpc_fraction_of_raw_stream: planned gRPC path throughput (tp=1) / a raw gRPC byte stream of the
  same size to the same receiver process (pre-built messages, nothing decoded).
- push_landing_in_place_over_protobuf (reference): how fast weight-sync lands a pushed version
  (both trainer ranks' PushShards messages: decode, verify each chunk's hash64, copy it into the
  shared-memory arena), decoding with the chunks left in place (what the service does) vs parsing
  with protobuf, which copies every chunk on parse and again on access.
- four_over_one_deployments: time to update 4 co-located deployments of one layout / time to
  update 1, commits included. One deployment reads its rectangles of the trainer chunks into its
  own memory (reshard-on-read); four share one copy (weight_sync/transport/shared_copy.py):
  weight-sync writes the version once, each deployment adopts it read-only and verifies a quarter
  of it. Printed beside it: processes that do nothing but copy the model out of shared memory (4 at
  once vs 1), what it would cost if every deployment kept its own copy of the weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import grpc
import numpy as np
import torch

from bench.common import emit, parse_args
from bench.harness.synthetic_weights import rank_requests
from bench.weight_sync_naive import NaiveLoader, add_bench_handlers, digests, naive_full, naive_resharded
from looprl.weightsync.v1 import weightsync_pb2
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, hf_params, rank_params
from services.weight_sync.plan import PlanCache
from services.weight_sync.planned_bucket import PlannedBucket
from services.weight_sync.transport import Delivery, Endpoint, GrpcTransport, ShmTransport
from services.weight_sync.versions import VersionStore
from services.weights import proto_dtype
from services.weights.checksum import hash64
from services.weights.wire import decode_push_request

BENCH = "weight_sync"
SINK = "/bench.Sink/Stream"
MAX_MSG = 512 << 20


def model_config(quick: bool) -> ModelConfig:
    if quick:  # ~100 MB fp32
        return ModelConfig(
            vocab_size=8000,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=128,
        )
    # ~1 GB fp32, Qwen2 shapes (hidden 2048, GQA 16/2 heads of 128).
    return ModelConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
    )


# ----------------------------------------------------------------------------- receivers
async def _serve_receivers(config_json: str, tp: int, naming: str) -> None:
    from services.weights import WeightOnlyEngine, WeightStager, add_engine_servicer

    config = ModelConfig.from_hf_dict(json.loads(config_json))
    layout = Layout(tp, naming)
    received = [0]

    async def sink(request_iterator, context):
        async for chunk in request_iterator:
            received[0] += len(chunk)
        return str(received[0]).encode()

    sink_handler = grpc.method_handlers_generic_handler(
        "bench.Sink", {"Stream": grpc.stream_unary_rpc_method_handler(sink)}
    )
    addresses, servers = [], []
    for r in range(tp):
        engine = WeightOnlyEngine(WeightStager(rank_params(config, layout, r), rank=r), keep=False)
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", MAX_MSG), ("grpc.max_send_message_length", MAX_MSG)]
        )
        add_engine_servicer(server, engine)
        server.add_generic_rpc_handlers((sink_handler,))
        add_bench_handlers(server, NaiveLoader(engine, config, layout, r))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        addresses.append(f"127.0.0.1:{port}")
    print("READY " + " ".join(addresses), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin


class Receivers:
    """One subprocess holding the ranks of one deployment."""

    def __init__(self, config: ModelConfig, layout: Layout, name: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.weight_sync",
                "--receiver",
                json.dumps(config.to_hf_dict()),
                str(layout.tp_size),
                layout.naming,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "READY", f"receiver failed to start: {line}"
        self.endpoints = [Endpoint(a, r, name) for r, a in enumerate(line[1:])]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.terminate()
        self.proc.wait(10)


# ------------------------------------------------------------------------------- sender
def pushed_version(config: ModelConfig, world: int = 2):
    """The version as weight-sync holds it after the trainer's 2 ranks pushed (no full copy kept)."""
    store = VersionStore()
    buf = None
    gen = torch.Generator().manual_seed(0)
    for name, shape in hf_params(config).items():
        full = torch.randn(shape, generator=gen) * 0.02
        for rank in range(world):
            for req in rank_requests(
                {name: full}, version=0, rank=rank, world=world, max_message_bytes=64 << 20
            ):
                buf = store.buffer_for(req)
                for i, c in enumerate(req.shards):
                    buf.add_chunk(rank, c, i)
        del full
    buf.ranks_done.update(range(world))
    return buf


def push_messages(buf) -> list[bytes]:
    """The version's PushShards messages as the trainer ranks sent them (one chunk each)."""
    out = []
    for (name, rank, row0), chunk in buf.chunks.items():
        shape, dtype = buf.params[name]
        data = chunk.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        req = weightsync_pb2.PushShardsRequest(version=0, trainer_rank=rank, trainer_world_size=2)
        req.shards.add(
            name=name,
            dtype=proto_dtype(dtype),
            global_shape=shape,
            row_offset=row0,
            rows=chunk.shape[0],
            data=data,
            hash64=hash64(data),
        )
        out.append(req.SerializeToString())
    return out


def push_landing_seconds(messages: list[bytes], decode, repeat: int) -> float:
    """Best time to land every message into a fresh version of one store (arenas reused)."""
    store, best = VersionStore(), float("inf")
    try:
        for v in range(repeat + 1):  # the first round warms the arena's pages
            start = time.perf_counter()
            buf = None
            for raw in messages:
                req = decode(raw)
                getattr(req, "head", req).version = v  # each round lands a new version
                buf = store.buffer_for(req)
                for i, chunk in enumerate(req.shards):
                    buf.add_chunk(req.trainer_rank, chunk, i)
            if v:
                best = min(best, time.perf_counter() - start)
            buf.ranks_done.update((0, 1))
            store.completed(buf)
    finally:
        store.close()
    return best


async def planned(transport, plan, buf, endpoints_by_rank, version):
    jobs = []
    for rp in plan.ranks:
        buckets = (PlannedBucket(s, rp.dtype, buf.chunks, buf.locations, buf.sums) for s in rp.buckets)
        jobs.append(
            transport.stage(Delivery(version, buckets, total_bytes=rp.nbytes), endpoints_by_rank[rp.rank])
        )
    results = {}
    for r in await asyncio.gather(*jobs):
        results.update(r)
    bad = [str(r.error) for r in results.values() if r.error is not None]
    assert not bad, bad
    await asyncio.gather(*(transport.commit(ep, version) for eps in endpoints_by_rank.values() for ep in eps))
    return sum(r.bytes_sent for r in results.values())


async def raw_stream(transport, address, total, chunk):
    method = transport.channel(address).stream_unary(
        SINK, request_serializer=lambda x: x, response_deserializer=lambda x: x
    )
    payload = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8).tobytes()
    n, rest = divmod(total, chunk)
    tail = payload[:rest]

    async def gen():
        for _ in range(n):
            yield payload
        if rest:
            yield tail

    await method(gen())
    return total


def memcpy_bandwidth(sources: list[np.ndarray], repeat: int = 3) -> float:
    """Single-thread memcpy of the same bytes the path moves: every trainer chunk of the version
    (where the shm path reads them) into one destination of the model's size (as the receiver's
    staging tensors are), chunk by chunk, pages of both already touched. Best of `repeat` passes
    like the paths it is compared with: on a shared machine noise only ever lowers a figure."""
    total = sum(s.nbytes for s in sources)
    dst = np.ones(total, np.uint8)  # touched: no page faults inside the timing
    best = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        pos = 0
        for s in sources:
            np.copyto(dst[pos : pos + s.nbytes], s)
            pos += s.nbytes
        best = max(best, total / (time.perf_counter() - t))
    return best


def cache_warm_memcpy_bandwidth(total: int, chunk: int, repeat: int = 3) -> float:
    """For reference only (printed, not a baseline): one `chunk`-byte buffer copied over and over.
    With a 32 MiB buffer and a 32 MiB L3 much of it stays in cache, so it runs faster than any copy
    of a model that does not fit in cache can, which is why the baseline is `memcpy_bandwidth`."""
    src = np.random.default_rng(1).integers(0, 255, chunk, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    reps = max(1, total // chunk)
    best = 0.0
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(reps):
            np.copyto(dst, src)
        best = max(best, reps * chunk / (time.perf_counter() - t))
    return best


def _memcpy_worker(regions_json: str) -> None:
    """One process that copies the version's chunks out of shared memory into its own buffer of the
    model's size each time the parent writes a line: a deployment's copy with nothing else."""
    from services.weights import ShmReader

    reader = ShmReader()
    sources = [np.frombuffer(reader.view(n, o, b), np.uint8) for n, o, b in json.loads(regions_json)]
    dst = np.ones(sum(s.nbytes for s in sources), np.uint8)
    print("READY", flush=True)
    for _ in sys.stdin:
        pos = 0
        for src in sources:
            np.copyto(dst[pos : pos + src.nbytes], src)
            pos += src.nbytes
        print("DONE", flush=True)


def concurrent_memcpy_seconds(buf, processes: int, repeat: int) -> float:
    """Wall time for `processes` processes to each copy every chunk of the version out of shared
    memory at once (best of `repeat`): what any design where each co-located deployment holds its
    own copy of the weights must at least spend, whatever the transport does."""
    regions = json.dumps([[*buf.locations[k], t.numel() * t.element_size()] for k, t in buf.chunks.items()])
    argv = [sys.executable, "-m", "bench.weight_sync", "--memcpy-worker", regions]
    procs = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    try:
        assert all(p.stdout.readline().strip() == "READY" for p in procs)
        best = float("inf")
        for _ in range(repeat + 1):  # the first pass faults the copies' pages in
            t = time.perf_counter()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            assert all(p.stdout.readline().strip() == "DONE" for p in procs)
            best = min(best, time.perf_counter() - t)
        return best
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(10)


def check_identical(
    committed: dict[str, dict[int, dict[str, int]]], config: ModelConfig, layout: Layout
) -> None:
    """Every path must end with the same committed weights on every rank (hash64 per tensor), and
    every tensor of the rank's layout must be there: fail loudly otherwise, a fast wrong path is no
    figure."""
    (first, reference), *others = committed.items()
    for rank in range(layout.tp_size):
        names = {p.name for p in rank_params(config, layout, rank)}
        if set(reference.get(rank, {})) != names:
            raise SystemExit(
                f"{first}: rank {rank} committed {sorted(reference.get(rank, {}))}, expected {sorted(names)}"
            )
    for path, sums in others:
        if sums != reference:
            bad = sorted(
                n for r in reference for n in reference[r] if sums.get(r, {}).get(n) != reference[r][n]
            )
            raise SystemExit(
                f"{path} committed different weights than {first}: {bad[:5]} ({len(bad)} tensors)"
            )


async def timed_async(fn, repeat):
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        nbytes = await fn()
        out.append((time.perf_counter() - t, nbytes))
    return min(out)  # best of: the machine is shared, noise only ever adds time


async def main_async(quick: bool) -> None:
    config = model_config(quick)
    bucket = 32 << 20
    repeat = 2
    # Shared-memory runs and memcpy passes take ~0.1 s each: more of them (the same number for the
    # path and its baseline) so that one run disturbed by other work on the machine decides less.
    fast_repeat = 5
    t0 = time.perf_counter()
    buf = pushed_version(config)
    model_bytes = buf.bytes_received
    print(
        f"model: {model_bytes / 1e6:.1f} MB fp32 in {len(buf.chunks)} chunks from 2 ranks "
        f"(prepared in {time.perf_counter() - t0:.1f}s)",
        flush=True,
    )
    cache = PlanCache()
    version = iter(range(1, 10_000))
    grpc_t = GrpcTransport(prefetch=2, max_message_bytes=MAX_MSG)
    shm_t = ShmTransport(segment_bytes=bucket, segments=3, max_message_bytes=MAX_MSG)
    rows = []
    figures = []
    notes = []
    try:
        # (a) planned vs naive, tp=2 fused deployment
        tp2 = Layout(2, "fused")
        plan2 = cache.get(buf.layout(), config, tp2, bucket)
        rec = Receivers(config, tp2, "tp2")
        try:
            eps = {e.rank: [e] for e in rec.endpoints}
            t_plan, b_plan = await timed_async(
                lambda: planned(grpc_t, plan2, buf, eps, next(version)), repeat + 1
            )
            committed = {"planned gRPC": await digests(grpc_t, rec.endpoints)}
            await naive_full(grpc_t, buf, rec.endpoints, next(version))  # warm: first calls, pages
            t_naive, b_naive = await timed_async(
                lambda: naive_full(grpc_t, buf, rec.endpoints, next(version)), repeat
            )
            committed["naive (full tensors)"] = await digests(grpc_t, rec.endpoints)
            t_lean, b_lean = await timed_async(
                lambda: naive_full(grpc_t, buf, rec.endpoints, next(version), lean=True), repeat
            )
            committed["naive, kit wire codec"] = await digests(grpc_t, rec.endpoints)
            t_resh, b_resh = await timed_async(
                lambda: naive_resharded(grpc_t, config, tp2, buf, rec.endpoints, next(version)), repeat
            )
            committed["naive resharded on rank 0"] = await digests(grpc_t, rec.endpoints)
            shm_eps = {r: [Endpoint(e[0].address, r, "tp2")] for r, e in eps.items()}
            t_plan_shm, _ = await timed_async(
                lambda: planned(shm_t, plan2, buf, shm_eps, next(version)), repeat + 1
            )
            committed["planned shm"] = await digests(grpc_t, rec.endpoints)
        finally:
            rec.close()
        check_identical(committed, config, tp2)
        rows += [
            ("tp2 planned gRPC", t_plan, b_plan),
            ("tp2 planned shm", t_plan_shm, b_plan),
            ("tp2 naive: gather, full tensor/call/rank", t_naive, b_naive),
            ("(ref.) same, kit's zero-copy wire codec", t_lean, b_lean),
            ("(ref.) tp2 naive resharded on rank 0", t_resh, b_resh),
        ]
        notes.append(
            f"tp2 updates committed byte-identical weights on every path ({', '.join(committed)}); "
            f"over planned gRPC, naive with the kit's wire codec: {t_lean / t_plan:.2f}x, "
            f"naive resharded on rank 0: {t_resh / t_plan:.2f}x"
        )
        # The same job (update the tp=2 deployment to the version) on both paths: model bytes per second.
        figures.append(
            ("planned_over_naive", model_bytes / t_plan, model_bytes / t_naive, t_naive / t_plan, ">= 5x")
        )

        # (b), (c): tp=1 over shm and gRPC vs memcpy and a raw stream
        tp1 = Layout(1, "hf")
        plan1 = cache.get(buf.layout(), config, tp1, bucket)
        rec = Receivers(config, tp1, "tp1")
        try:
            ep = rec.endpoints[0]
            t_grpc, b_grpc = await timed_async(
                lambda: planned(grpc_t, plan1, buf, {0: [ep]}, next(version)), repeat + 1
            )
            t_raw, b_raw = await timed_async(
                lambda: raw_stream(grpc_t, ep.address, b_grpc, bucket), repeat + 1
            )
            shm_ep = Endpoint(ep.address, 0, "tp1")
            await planned(
                shm_t, plan1, buf, {0: [shm_ep]}, next(version)
            )  # warm: the receiver maps the arena
            sources = [t.view(torch.uint8).numpy().reshape(-1) for t in buf.chunks.values()]
            memcpy = memcpy_bandwidth(sources, fast_repeat)
            t_shm, b_shm = await timed_async(
                lambda: planned(shm_t, plan1, buf, {0: [shm_ep]}, next(version)), fast_repeat
            )
            memcpy = max(memcpy, memcpy_bandwidth(sources, fast_repeat))  # right before and after
            warm = cache_warm_memcpy_bandwidth(b_shm, bucket, fast_repeat)
        finally:
            rec.close()
        rows += [
            ("tp1 planned gRPC", t_grpc, b_grpc),
            ("tp1 raw gRPC byte stream", t_raw, b_raw),
            ("tp1 planned shm", t_shm, b_shm),
            ("memcpy of the same bytes (1 thread)", b_shm / memcpy, b_shm),
            (f"(ref.) {bucket >> 20} MiB buffer reused, cache-warm", b_shm / warm, b_shm),
        ]
        figures.append(("shm_fraction_of_memcpy", b_shm / t_shm, memcpy, (b_shm / t_shm) / memcpy, ">= 0.5"))
        figures.append(
            (
                "grpc_fraction_of_raw_stream",
                b_grpc / t_grpc,
                b_raw / t_raw,
                (b_grpc / t_grpc) / (b_raw / t_raw),
                ">= 0.7",
            )
        )

        # (d) four co-located deployments vs one (shared copy vs reshard-on-read)
        recs = [Receivers(config, tp1, f"d{i}") for i in range(4)]
        try:
            one = {0: [Endpoint(recs[0].endpoints[0].address, 0, "d0")]}
            four = {0: [Endpoint(r.endpoints[0].address, 0, f"d{i}") for i, r in enumerate(recs)]}
            await planned(shm_t, plan1, buf, four, next(version))  # warm every receiver
            t_one, b_one = await timed_async(
                lambda: planned(shm_t, plan1, buf, one, next(version)), fast_repeat
            )
            t_four, b_four = await timed_async(
                lambda: planned(shm_t, plan1, buf, four, next(version)), fast_repeat
            )
        finally:
            for r in recs:
                r.close()
        floor_one = concurrent_memcpy_seconds(buf, 1, fast_repeat)
        floor_four = concurrent_memcpy_seconds(buf, 4, fast_repeat)
        rows += [
            ("1 deployment (shm)", t_one, b_one),
            ("4 deployments (one shared copy)", t_four, b_four),
            ("(ref.) memcpy only, 1 process", floor_one, b_one),
            ("(ref.) memcpy only, 4 processes at once", floor_four, 4 * b_one),
        ]
        figures.append(("four_over_one_deployments", t_four, t_one, t_four / t_one, "<= 2x"))
        notes.append(
            f"four_over_one for bare copies on this host (4 processes each copying the model "
            f"out of shared memory vs 1): {floor_four / floor_one:.2f}x"
        )
    finally:
        await grpc_t.close()
        await shm_t.close()

    # (reference) landing a push: chunks decoded in place vs parsed by protobuf
    messages = push_messages(buf)
    pushed_bytes = sum(len(m) for m in messages)
    t_place = push_landing_seconds(messages, decode_push_request, repeat)
    t_proto = push_landing_seconds(messages, weightsync_pb2.PushShardsRequest.FromString, repeat)
    del messages
    rows += [
        ("push landing, chunks decoded in place", t_place, pushed_bytes),
        ("push landing, parsed by protobuf", t_proto, pushed_bytes),
    ]
    figures.append(
        (
            "push_landing_in_place_over_protobuf",
            pushed_bytes / t_place,
            pushed_bytes / t_proto,
            t_proto / t_place,
            "reference",
        )
    )

    print(f"\n{'path':<44}{'seconds':>10}{'MB':>10}{'GB/s':>8}")
    for name, secs, nbytes in rows:
        print(f"{name:<44}{secs:>10.3f}{nbytes / 1e6:>10.1f}{nbytes / secs / 1e9:>8.2f}")
    print(
        f"\ncpu cores: {os.cpu_count()}; bucket {bucket >> 20} MiB; best of {repeat}+ runs "
        f"(shared memory and memcpy: best of {fast_repeat})"
    )
    for note in notes:
        print(note)
    print()
    units = {
        "planned_over_naive": "bytes/s",
        "shm_fraction_of_memcpy": "bytes/s",
        "grpc_fraction_of_raw_stream": "bytes/s",
        "four_over_one_deployments": "s",
        "push_landing_in_place_over_protobuf": "bytes/s",
    }
    for fig, value, baseline, ratio, target in figures:
        emit(BENCH, fig, value, baseline, ratio, units[fig], target)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--receiver":
        asyncio.run(_serve_receivers(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--memcpy-worker":
        _memcpy_worker(sys.argv[2])
        return
    args = parse_args(__doc__.splitlines()[0])
    asyncio.run(main_async(args.quick))


if __name__ == "__main__":
    main()
