"""What tracing costs the loop: steps/s of the default recipe with tracing on (every service and
Ray actor exporting its spans over OTLP/gRPC to a local receiver this bench starts) vs off (no
exporter: spans are created but not recorded), through the real service loop.

One stack per run (a stack serves one run), the same run length on both sides. A warm-up run
comes first and is not counted (first start of Ray, imports, page cache); then the sides
alternate, in swapped order every other round. The figure is the round with the median on/off
ratio: the two runs of a round are back to back, so they share the machine's state, and one
disturbed run moves the median by one rank, not the figure. (Best-vs-best, printed beside it,
compares runs from different rounds: on a 2-core host the "off" side's best alone varied 2.4-3.3
steps/s.) Each run's first step is excluded from its steps/s (RunResult.steps_per_second). The
receiver answers every export at once and counts spans, so an "on" run that exported nothing is an
error, not a free figure.

    python -m bench.tracing_cost [--quick]
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench.common import emit, parse_args
from bench.loop_harness import ROOT, RunResult, run_on_fresh_stack, with_overrides

TARGET_RATIO = 0.9  # tracing costs under 10% of the loop's steps/s
WARMUP_STEPS = 4


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A local OTLP/gRPC trace endpoint that counts what it is sent and keeps nothing."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans = 0
        self.exports = 0
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def Export(self, request, context):  # the OTLP service's method name
        count = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        with self._lock:
            self.spans += count
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=1).wait()


def tracing_env(receiver: OtlpReceiver | None) -> dict[str, str]:
    """Every service's tracing settings: OTLP to the receiver, or nowhere (no span log either)."""
    endpoint = f"127.0.0.1:{receiver.port}" if receiver is not None else ""
    return {"LOOPRL_OTLP_ENDPOINT": endpoint, "LOOPRL_SPAN_LOG": ""}


def main() -> None:
    args = parse_args(__doc__)
    steps = 10 if args.quick else 100
    rounds = 1 if args.quick else 5
    base = (ROOT / "configs" / "digits_grpo.toml").read_text()
    recipe = with_overrides(base, run={"steps": steps})
    receiver = OtlpReceiver().start()
    runs: dict[str, list[RunResult]] = {"off": [], "on": []}
    spans: dict[str, list[int]] = {"off": [], "on": []}
    try:
        print(f"warm-up: {WARMUP_STEPS} steps, not counted ...", flush=True)
        run_on_fresh_stack(
            with_overrides(base, run={"steps": WARMUP_STEPS}), "bench-tracing-warmup", tracing_env(None)
        )
        for round_ in range(rounds):
            for side in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
                before = receiver.spans
                env = tracing_env(receiver if side == "on" else None)
                print(f"round {round_}: tracing {side} ...", flush=True)
                result = run_on_fresh_stack(recipe, f"bench-tracing-{side}-{round_}", env)
                runs[side].append(result)
                # `down` has flushed every service's exporter by now.
                spans[side].append(receiver.spans - before)
                print(f"  {result.steps_per_second:.3f} steps/s, {spans[side][-1]} spans", flush=True)
    finally:
        receiver.stop()
    if any(spans["off"]) or not all(spans["on"]):
        raise RuntimeError(f"spans received: tracing off {spans['off']}, tracing on {spans['on']}")
    print(f"{'tracing':<10}{'steps':>6}{'seconds':>10}{'steps/s':>10}{'spans':>10}{'spans/step':>12}")
    for side in ("off", "on"):
        for r, n in zip(runs[side], spans[side], strict=True):
            print(
                f"{side:<10}{len(r.run.history):>6}{r.wall_seconds:>10.1f}{r.steps_per_second:>10.3f}"
                f"{n:>10}{n / len(r.run.history):>12.1f}"
            )
    pairs = sorted(
        (
            (on.steps_per_second, off.steps_per_second)
            for on, off in zip(runs["on"], runs["off"], strict=True)
        ),
        key=lambda pair: pair[0] / pair[1],
    )
    on, off = pairs[len(pairs) // 2]
    emit(
        "tracing_cost",
        "steps_per_s_tracing_on_over_off",
        on,
        off,
        on / off,
        "steps/s (the median pair of rounds)",
        f">= {TARGET_RATIO}",
        samples=[a / b for a, b in pairs],
    )
    best_on = max(r.steps_per_second for r in runs["on"])
    best_off = max(r.steps_per_second for r in runs["off"])
    emit(
        "tracing_cost", "best_on_over_best_off", best_on, best_off, best_on / best_off, "steps/s", "reference"
    )
    per_step = max(spans["on"]) / steps
    emit("tracing_cost", "spans_per_step", per_step, None, None, "spans/step", "reference")


if __name__ == "__main__":
    main()
