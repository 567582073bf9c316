"""Runs recipes through a real local stack for the loop benchmarks (async_vs_sync, loop_vs_single_process).

A run that stops progressing (the gateway reads it STALLED, or nothing moves for `stall_s`) is
stopped and raises RunStalled with the run's own reason, instead of holding the benchmark forever.
"""

from __future__ import annotations

import random
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from gateway.stack import StackPorts, down, unwind_on_terminate, up
from looprl.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from services.kit.local.infra import port_is_free

ROOT = Path(__file__).resolve().parent.parent


def with_overrides(recipe: str, **sections: dict[str, object]) -> str:
    """The recipe text with `key = value` lines replaced inside the named [sections]."""
    for section, values in sections.items():
        for key, value in values.items():
            literal = str(value).lower() if isinstance(value, bool) else repr(value).replace("'", '"')
            recipe, count = re.subn(
                rf"(\[{section}\][^\[]*?^){key} = .*?$", rf"\g<1>{key} = {literal}", recipe, flags=re.M | re.S
            )
            if count != 1:
                raise KeyError(f"{section}.{key} not found in the recipe")
    return recipe


@dataclass
class RunResult:
    run: gateway_pb2.Run
    wall_seconds: float
    """From CreateRun to the run's completion."""
    done_at: dict[int, float]
    """perf_counter time at which the gateway first reported each step."""

    @property
    def steady_seconds(self) -> float:
        """From the first step's completion to the last's: the warm-up step excluded."""
        steps = [h.step for h in self.run.history]
        return self.done_at[steps[-1]] - self.done_at[steps[0]]

    @property
    def steps_per_second(self) -> float:
        return (len(self.run.history) - 1) / max(self.steady_seconds, 1e-9)

    @property
    def trained_tokens_per_second(self) -> float:
        """Packed micro-batch tokens of the steps after the first, over steady_seconds."""
        tokens = sum(h.train_tokens_per_second * h.seconds for h in self.run.history[1:])
        return tokens / max(self.steady_seconds, 1e-9)


def _free_base() -> int:
    for _ in range(500):
        base = random.randrange(
            21000, 25800
        )  # clear of client sockets (32768+) and Ray workers (10002-19999)
        if all(port_is_free(base + i) and port_is_free(base + 100 + i) for i in range(8)):
            return base
    raise RuntimeError("no free port range")


def _free(lo: int, hi: int) -> int:
    return next(p for p in random.sample(range(lo, hi), 500) if port_is_free(p))


@contextmanager
def local_stack(
    recipe_text: str | None, env: dict[str, str] | None = None
) -> Iterator[tuple[gateway_pb2_grpc.GatewayServiceStub, tuple]]:
    """A whole stack on free ports, with the router's deployments taken from recipe_text (started
    with the stack, outside the measured run), or None: each run starts its own; `env` is added to
    every service's environment (e.g. where to export traces)."""
    # A bench stopped by `timeout` or a scheduler still brings its stack down.
    with unwind_on_terminate(), tempfile.TemporaryDirectory(prefix="looprl-bench-") as tmp:
        state_dir = Path(tmp)
        router_env = {}
        if recipe_text is not None:
            recipe_path = state_dir / "recipe.toml"
            recipe_path.write_text(recipe_text)
            router_env = {"LOOPRL_INFERENCE_ROUTER_RECIPE": str(recipe_path)}
        ports = StackPorts(
            nats=_free(26000, 26500), ray=_free(27000, 28000), base=_free_base(), http=_free(26500, 27000)
        )
        state = up(state_dir, ports, {**router_env, **(env or {})}, log=lambda *_: None)
        channel = grpc.insecure_channel(state.service("gateway").address)
        try:
            yield (
                gateway_pb2_grpc.GatewayServiceStub(channel),
                (("authorization", f"Bearer {state.gateway_token}"),),
            )
        finally:
            channel.close()
            down(state_dir, log=lambda *_: None)


# How long a benchmark's run may go without a step, a fed episode or a weight delivery before the
# harness stops it (the first step loads the model and starts every replica).
STALL_S = 180.0


class RunStalled(RuntimeError):
    """A run stopped progressing; it was stopped, and the message says where and why."""


def _progress(run: gateway_pb2.Run) -> tuple[int, ...]:
    return (
        run.step,
        run.episodes_published,
        len(run.weight_syncs),
        run.rollouts_trained,
        run.resampled_groups,
    )


def stalled_message(run: gateway_pb2.Run, quiet_s: float) -> str:
    """Where the run stopped and why, in the run's own words."""
    if run.stalled_reason:
        why = run.stalled_reason
    elif run.last_error.component:
        why = f"last error from {run.last_error.component}: {run.last_error.message}"
    else:
        why = "no component reported an error"
    return (
        f"run {run.run_id} stalled at step {run.step}/{run.total_steps} (nothing progressed for "
        f"{quiet_s:.0f}s): {why}; episodes published {run.episodes_published}, trained "
        f"{run.rollouts_trained}, dropped {dict(run.rollouts_dropped) or 'none'}, groups resampled "
        f"{run.resampled_groups}"
    )


def run_recipe(
    stub: gateway_pb2_grpc.GatewayServiceStub,
    metadata: tuple,
    recipe_text: str,
    run_id: str,
    on_update: Callable[[gateway_pb2.Run], None] | None = None,
    stall_s: float = STALL_S,
) -> RunResult:
    """Create the run and follow it to completion, noting when each step is reported (and handing
    each update of the run to `on_update`); a run that stalls is stopped and raises RunStalled."""
    start = time.perf_counter()
    stub.CreateRun(gateway_pb2.CreateRunRequest(recipe_toml=recipe_text, run_id=run_id), metadata=metadata)
    final, done_at = None, {}
    watch = stub.WatchRun(gateway_pb2.WatchRunRequest(run_id=run_id), metadata=metadata)
    # WatchRun answers only when the run changes: a quiet run is noticed by the clock beside it.
    last = [time.monotonic()]
    stop = threading.Event()

    def watchdog() -> None:
        while not stop.wait(1.0):
            if time.monotonic() - last[0] > stall_s:
                watch.cancel()
                return

    threading.Thread(target=watchdog, name=f"watchdog-{run_id}", daemon=True).start()
    stalled = False
    try:
        for update in watch:
            if final is None or _progress(update.run) != _progress(final):
                last[0] = time.monotonic()
            final = update.run
            if on_update is not None:
                on_update(final)
            for h in final.history:
                done_at.setdefault(h.step, time.perf_counter())
            if final.state == gateway_pb2.RUN_STATE_STALLED:
                stalled = True
                break
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            raise
        stalled = True
    finally:
        stop.set()
        watch.cancel()
    if stalled:
        quiet = time.monotonic() - last[0]
        run = stub.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), metadata=metadata).run
        stub.StopRun(gateway_pb2.StopRunRequest(run_id=run_id), metadata=metadata, timeout=30)
        raise RunStalled(stalled_message(run, quiet))
    elapsed = time.perf_counter() - start
    if final is None or final.state != gateway_pb2.RUN_STATE_COMPLETED:
        raise RuntimeError(
            f"run {run_id} did not complete: {final.state if final else None} {final.error if final else ''}"
        )
    return RunResult(final, elapsed, done_at)


def run_on_fresh_stack(
    recipe_text: str,
    run_id: str,
    env: dict[str, str] | None = None,
    on_update: Callable[[gateway_pb2.Run], None] | None = None,
    *,
    run_starts_deployments: bool = False,
) -> RunResult:
    """A stack serves one run: bring one up for this run and down after. The router starts the
    recipe's deployments with the stack, outside the measured run, unless `run_starts_deployments`:
    then the run starts them, as `looprl run --local` does."""
    with local_stack(None if run_starts_deployments else recipe_text, env) as (stub, metadata):
        return run_recipe(stub, metadata, recipe_text, run_id, on_update)
