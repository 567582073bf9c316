"""Measure the project's engine into a cost-model file: the stage costs the simulator and the tuner
read (services/decisions/cost_model.py), taken from the real continuous-batching engine end to end
(model, KV cache, sampler and scheduler), on the CPU or on a GPU.

For each batch size B and prompt length L the engine serves B requests of L random prompt tokens:

- with max_tokens 1: one prefill step (the first token is sampled from it), its seconds a prefill
  point (B, L);
- with max_tokens T: that prefill and T - 1 decode steps; (seconds - prefill seconds) / (T - 1) is a
  decode point of B sequences at context L + T/2.

Sampling never stops early (no stop tokens), the engine's prefill budget and slots hold the whole
batch, every point is the median of `repeat` runs after a warm-up. Points that would pass the
deadline are skipped and listed, so a measurement fits its time budget.
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from services.decisions.cost_model import FORMAT

# (max_batch, max_model_len, max_prefill_tokens) -> a started engine holding weights.
EngineFactory = Callable[[int, int, int], Any]


async def _serve(engine: Any, batch: int, prompt: int, max_tokens: int, vocab: int, seed: int) -> float:
    from services.inference_router.engine.base import EngineRequest, SamplingParams

    requests = [
        EngineRequest(
            [(seed * 7919 + i * 31 + j * 17) % (vocab - 1) + 1 for j in range(prompt)],
            SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + i + 1),
        )
        for i in range(batch)
    ]
    start = time.perf_counter()
    results = await engine.generate(requests)
    seconds = time.perf_counter() - start
    produced = {len(c.token_ids) for r in results for c in r.completions}
    if produced != {max_tokens}:
        raise RuntimeError(f"engine produced {sorted(produced)} tokens per request, asked for {max_tokens}")
    return seconds


async def measure_engine(
    make_engine: EngineFactory,
    vocab_size: int,
    *,
    batches: Sequence[int],
    prompt_lengths: Sequence[int],
    decode_steps: int = 16,
    repeat: int = 3,
    deadline: float | None = None,
    synchronize: Callable[[], None] | None = None,
    max_prefill_tokens: int = 0,
    log: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Prefill and decode points of the engine `make_engine` builds; `deadline` (perf_counter time)
    skips the points that would start after it. `max_prefill_tokens` bounds one prefill step (0: a
    whole batch at once); a batch beyond it is prefilled over several steps, as the engine would."""
    if decode_steps < 2:
        raise ValueError("decode_steps: at least 2 (one decode step after the prefill)")
    prefill_points, decode_points, skipped = [], [], []
    longest = max(prompt_lengths) + decode_steps
    engine = make_engine(max(batches), longest, max_prefill_tokens or max(batches) * max(prompt_lengths))
    try:
        # Warm-up: kernels, and the allocator grown to the largest batch.
        await _serve(engine, 1, min(prompt_lengths), decode_steps, vocab_size, 0)
        await _serve(engine, max(batches), min(prompt_lengths), decode_steps, vocab_size, 0)
        for batch in batches:
            for prompt in prompt_lengths:
                if deadline is not None and time.perf_counter() > deadline:
                    skipped.append({"batch": batch, "prompt_tokens": prompt})
                    continue
                firsts, wholes = [], []
                for r in range(repeat):
                    firsts.append(await _serve(engine, batch, prompt, 1, vocab_size, r))
                    wholes.append(await _serve(engine, batch, prompt, decode_steps, vocab_size, r))
                    if synchronize is not None:
                        synchronize()
                first, whole = statistics.median(firsts), statistics.median(wholes)
                step = max(whole - first, 1e-9) / (decode_steps - 1)
                prefill_points.append({"batch": batch, "prompt_tokens": prompt, "seconds": first})
                decode_points.append(
                    {
                        "batch": batch,
                        "context_tokens": prompt + decode_steps // 2,
                        "seconds_per_step": step,
                        "tokens_per_s": batch / step,
                    }
                )
                log(
                    f"batch {batch:>4} prompt {prompt:>5}: prefill {batch * prompt / first:>12,.0f} tok/s, "
                    f"decode {batch / step:>10,.0f} tok/s ({step * 1e3:.2f} ms/step)"
                )
    finally:
        await engine.close()
    data: dict[str, Any] = {
        "format": FORMAT,
        "prefill": prefill_points,
        "decode": decode_points,
        "created_by": "sim/engine_costs.py",
        "created_unix": time.time(),
    }
    if skipped:
        data["skipped"] = skipped
    return data


def cpu_name() -> str:
    """What a CPU cost model was measured on."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import os

    return f"cpu: {name} ({os.cpu_count()} cores)"


def cpu_engine_factory(
    config: Any, seed: int = 0, device: str = "cpu", dtype: str = "float32"
) -> EngineFactory:
    """Builds the project's engine (services/inference_router/engine/cpu.py) for `config` with seeded
    random weights: stage costs do not depend on the weights' values."""

    def make(max_batch: int, max_model_len: int, max_prefill_tokens: int) -> Any:
        import torch

        from services.inference_router.engine.cpu import CPUEngine
        from services.inference_router.engine.scheduler import SchedulerLimits
        from services.modeling.layouts import Layout
        from services.modeling.qwen2 import Qwen2ForCausalLM

        model = Qwen2ForCausalLM(config, seed=None)
        model.init_weights(seed, std=0.02)
        weights = {k: v.detach() for k, v in model.state_dict().items()}
        engine = CPUEngine.create(
            config,
            weights,
            0,
            layout=Layout(1, "hf", dtype),
            max_batch_size=max_batch,
            max_model_len=max_model_len,
            limits=SchedulerLimits(max_prefill_tokens=max_prefill_tokens),
            device=device,
        )
        del model
        if device != "cpu":
            torch.cuda.synchronize()
        return engine.start()

    return make


def measure_cpu_engine(config: Any, **kw: Any) -> dict[str, Any]:
    """A cost-model file's data for the CPU engine on this machine."""
    data = asyncio.run(measure_engine(cpu_engine_factory(config), config.vocab_size, **kw))
    data.update(
        device=cpu_name(),
        device_kind="cpu",
        dtype="float32",
        model={"name": "engine-under-test", **config.to_dict()},
    )
    return data
