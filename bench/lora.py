"""LoRA vs full weights: what one weight version costs to move, and serving two runs from one base.

    python -m bench.lora [--quick]

1. Bytes and seconds per weight version on the 10M model's architecture (bench/peer_trl_realistic.py
   MODEL, configs/math_10m_grpo.toml), full fine-tuning vs LoRA at rank 16 on the recipe's default
   target modules (the attention projections; every linear layer is printed beside it): the
   trainer's own push messages (services/trainer/shards.py) are ingested by weight-sync's version
   store, planned for a tp=1 deployment and assembled into buckets (weight-sync's real plan and
   bucket code), and staged and committed by a replica's WeightStager; the bytes are the plan's,
   the seconds that whole path's. Figures `full_over_lora_bytes_per_version` (target >= 20) and
   `lora_seconds_per_version` (baseline: the full version).
2. Generation for two LoRA runs of one base: one CPU engine serving both runs' adapters (each
   request with its own, batched together) vs two engines, one per run, generating at once. The
   figure is steps/s of the generation phase of a step of both runs (each run's group of requests),
   `lora_shared_over_separate_generation_steps_per_s`.
3. With `--stack`: two LoRA runs (`lora_recipe`) of the 10M model warm-started on the default task
   (`ensure_digits_model`: models/qwen2-10m-digits, built when missing, several minutes) on that
   task (configs/digits_grpo.toml's digit reversal), side by side on a local stack, once sharing one
   deployment (`shared = true`) and once with a deployment each:
   `lora_shared_over_separate_steps_per_s` (the two runs' mean steps/s), with each run's reward
   over its first and last steps printed beside it.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import torch

from bench.common import emit, median, parse_args, timed

BENCH = "lora"
RANK = 16


def _model(config, lora_spec=None, seed: int = 0):
    from services.modeling.lora import inject
    from services.modeling.qwen2 import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(config, seed=seed)
    if lora_spec is not None:
        inject(model, lora_spec, seed=seed)
        with torch.no_grad():  # a trained adapter: B away from zero
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.02)
    return model


def deliver_version(model, config, adapters_only: bool) -> tuple[int, float]:
    """(bytes delivered to a tp=1 replica, seconds) of one version through the trainer's push
    messages, weight-sync's version store, plan and buckets, and the replica's stager."""
    from looprl.inference.v1 import inference_pb2
    from services.modeling.layouts import Layout, rank_params
    from services.trainer.shards import push_requests
    from services.weight_sync.plan import build_deployment_plan
    from services.weight_sync.planned_bucket import PlannedBucket
    from services.weight_sync.versions import VersionStore
    from services.weights import WeightStager
    from services.weights.wire import encode_stage_request

    layout = Layout(1, "hf")
    start = time.perf_counter()
    store, buf = VersionStore(shm=False), None
    config_json = json.dumps(config.to_hf_dict())
    for request in push_requests(model, 1, 0, 1, "bench", 16 << 20, None, config_json, adapters_only):
        request = type(request).FromString(request.SerializeToString())  # as received over gRPC
        buf = store.buffer_for(request)
        for i, chunk in enumerate(request.shards):
            buf.add_chunk(0, chunk, i)
        if request.last:
            buf.ranks_done.add(0)
    assert buf is not None and buf.complete
    plan = build_deployment_plan(buf.layout(), config, layout, bucket_bytes=8 << 20)
    [rank_plan] = plan.ranks
    stager = WeightStager(rank_params(config, layout, 0))
    for spec in rank_plan.buckets:
        bucket = PlannedBucket(spec, rank_plan.dtype, buf.chunks)
        payload = memoryview(bytearray(bucket.nbytes))
        wire = encode_stage_request(bucket, payload, version=1, slice_data=bucket.fill(payload))
        stager.stage(inference_pb2.StageWeightsRequest.FromString(wire))
    stager.commit(1)
    return plan.nbytes, time.perf_counter() - start


async def _generate(engine, requests) -> int:
    results = await engine.generate(requests)
    return sum(len(c.token_ids) for r in results for c in r.completions)


def generation_steps_per_s(
    config, base_sd, adapters, group: int, max_tokens: int, repeat: int
) -> tuple[float, float]:
    """(shared, separate) steps/s of generating one group of requests for each of two runs."""
    from services.inference_router.engine.base import EngineRequest, SamplingParams
    from services.inference_router.engine.cpu import CPUEngine

    adapter_config = config.with_lora(adapters[0][0])

    def requests(run: str, seed: int) -> list:
        prompt = [(7 * seed + i) % 200 + 10 for i in range(24)]
        return [
            EngineRequest(
                prompt,
                SamplingParams(temperature=1.0, max_tokens=max_tokens, n=group, seed=seed),
                adapter=run,
            )
        ]

    async def run() -> tuple[float, float]:
        shared = CPUEngine.create(config, base_sd, max_batch_size=2 * group, max_model_len=128)
        separate = [
            CPUEngine.create(config, base_sd, max_batch_size=group, max_model_len=128) for _ in adapters
        ]
        try:
            for i, (_, state) in enumerate(adapters):
                await shared.serve_adapter(f"run-{i}", 1, adapter_config, state)
                await separate[i].serve_adapter(f"run-{i}", 1, adapter_config, state)

            async def shared_step(seed: int) -> None:
                await _generate(shared, requests("run-0", seed) + requests("run-1", seed + 1))

            async def separate_step(seed: int) -> None:
                await asyncio.gather(
                    _generate(separate[0], requests("run-0", seed)),
                    _generate(separate[1], requests("run-1", seed + 1)),
                )

            times: dict[str, list[float]] = {"shared": [], "separate": []}
            for step in range(repeat + 1):  # the first of each is a warm-up
                for name, fn in (("shared", shared_step), ("separate", separate_step)):
                    start = time.perf_counter()
                    await fn(100 + step)
                    if step:
                        times[name].append(time.perf_counter() - start)
            return 1 / median(times["shared"]), 1 / median(times["separate"])
        finally:
            await shared.close()
            for engine in separate:
                await engine.close()

    return asyncio.run(run())


ROOT = Path(__file__).resolve().parent.parent
DIGITS_MODEL_DIR = ROOT / "models" / "qwen2-10m-digits"
# SFT steps of the 10M model on the default task before its LoRA runs: enough that it answers in the
# task's form and is partly right, so groups of 8 differ and GRPO has a signal to sharpen.
DIGITS_WARM_START_STEPS = 400
LORA_LR = 1e-3


def default_task() -> dict:
    """configs/digits_grpo.toml's [environment]: the task `make run` trains on."""
    import tomllib

    return tomllib.loads((ROOT / "configs" / "digits_grpo.toml").read_text())["environment"]


def ensure_digits_model(directory: Path = DIGITS_MODEL_DIR) -> Path:
    """The 10M model (bench/peer_trl_realistic.py MODEL: its architecture, its byte-level BPE and chat
    template) warm-started on the default task with 2,000 of its tasks (a seed no run uses), built in
    `directory` once (deterministic) and again when what it is built from changed."""
    import hashlib

    from bench.peer_trl_realistic import architecture
    from tools.hf_warm_start import environment_examples

    task = default_task()
    examples = environment_examples(task["name"], task["config"], 2000, 0)
    digest = hashlib.sha256(
        json.dumps([architecture(), DIGITS_WARM_START_STEPS, examples]).encode()
    ).hexdigest()
    stamp = directory / "warm_start.sha256"  # written after the whole model
    if not (stamp.exists() and stamp.read_text() == digest):
        from tools.build_hf_model import build

        print(f"building {directory} ({DIGITS_WARM_START_STEPS} SFT steps on the default task)", flush=True)
        build(directory, sft_steps=DIGITS_WARM_START_STEPS, sft_examples=examples, **architecture())
        stamp.write_text(digest)
    return directory


def lora_recipe(model: str | Path, name: str, seed: int, steps: int, deployment: str) -> str:
    """A LoRA run (rank 16, every linear layer) of `model` on the default task; `deployment` is the
    body of its [[deployments]] table (name, shared, max_loras)."""
    task = default_task()
    config = ", ".join(f"{k} = {json.dumps(v)}" for k, v in task["config"].items())
    return f"""
[run]
name = "{name}"
seed = {seed}
steps = {steps}
[model]
path = "{model}"
tokenizer = "{model}"
[model.lora]
rank = {RANK}
alpha = {2.0 * RANK}
target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
[environment]
name = "{task["name"]}"
reward = "{task["reward"]}"
config = {{ {config} }}
[sampling]
max_tokens = 6
[batch]
rollouts_per_step = 64
group_size = 8
[optimizer]
lr = {LORA_LR}
warmup_steps = 2
[trainer]
world_size = 1
[[deployments]]
{deployment}
max_model_len = 128
max_batch_size = 64
"""


def two_runs_on_a_stack(model: str, steps: int, shared: bool) -> list:
    """Two LoRA runs of `model` side by side on a fresh local stack; their RunResults."""
    from concurrent.futures import ThreadPoolExecutor

    from bench.loop_harness import local_stack, run_recipe

    deployment = 'name = "lora"\nshared = true\nmax_loras = 2' if shared else 'name = "lora"'
    with local_stack(None) as (stub, metadata), ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(
                run_recipe,
                stub,
                metadata,
                lora_recipe(model, f"lora-{i}", i, steps, deployment),
                f"lora-{i}",
            )
            for i in range(2)
        ]
        return [f.result() for f in futures]


def stack_figures(quick: bool) -> None:
    model = str(ensure_digits_model())
    steps = 6 if quick else 30
    rates = {}
    for shared in (True, False):
        results = two_runs_on_a_stack(model, steps, shared)
        rates[shared] = sum(r.steps_per_second for r in results) / len(results)
        for r in results:
            rewards = [h.reward_mean for h in r.run.history]
            k = max(1, len(rewards) // 5)
            print(
                f"{'shared' if shared else 'own'} deployment, {r.run.run_id}: {r.steps_per_second:.2f} steps/s, "
                f"reward first {k} steps {sum(rewards[:k]) / k:.3f} -> last {k} {sum(rewards[-k:]) / k:.3f}"
            )
    emit(
        BENCH,
        "lora_shared_over_separate_steps_per_s",
        rates[True],
        rates[False],
        rates[True] / rates[False],
        "steps/s",
        ">= 1 (one base for both runs)",
    )


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0],
        lambda p: p.add_argument("--stack", action="store_true", help="also two LoRA runs on a local stack"),
    )
    from bench.peer_trl_realistic import MODEL
    from services.kit.config.recipe import LoraSection
    from services.modeling.config import ModelConfig
    from services.modeling.lora import TARGETS, LoraSpec, adapter_state_dict

    torch.set_num_threads(1)
    config = MODEL if not args.quick else ModelConfig.tiny(vocab_size=1024, num_hidden_layers=4)
    spec = LoraSpec(RANK, 2.0 * RANK, tuple(LoraSection().target_modules))
    full_model, lora_model = _model(config), _model(config, spec)
    every_linear = LoraSpec(RANK, 2.0 * RANK, TARGETS)
    all_bytes, _ = deliver_version(_model(config, every_linear), config.with_lora(every_linear), True)
    repeat = 2 if args.quick else 5
    full_bytes, _ = deliver_version(full_model, config, False)
    lora_bytes, _ = deliver_version(lora_model, config.with_lora(spec), True)
    full_s = median(timed(lambda: deliver_version(full_model, config, False), repeat=repeat))
    lora_s = median(timed(lambda: deliver_version(lora_model, config.with_lora(spec), True), repeat=repeat))
    arch = f"{sum(p.numel() for p in full_model.parameters()) / 1e6:.1f}M-parameter model, LoRA rank {RANK}"
    print(
        f"{arch}: full {full_bytes:,} B in {full_s * 1e3:.1f} ms; LoRA on {', '.join(spec.targets)} "
        f"{lora_bytes:,} B in {lora_s * 1e3:.1f} ms; on every linear layer {all_bytes:,} B "
        f"({full_bytes / all_bytes:.1f}x fewer than full)"
    )
    emit(
        BENCH,
        "full_over_lora_bytes_per_version",
        full_bytes / lora_bytes,
        None,
        None,
        "x",
        ">= 20 at rank 16 on the 10M model",
    )
    emit(BENCH, "lora_bytes_per_version", lora_bytes, full_bytes, lora_bytes / full_bytes, "bytes", "")
    emit(BENCH, "lora_seconds_per_version", lora_s, full_s, lora_s / full_s, "s", "< full")

    base_sd = full_model.hf_state_dict()
    adapters = []
    for seed in (1, 2):
        adapted = _model(config, spec, seed=0)
        with torch.no_grad():
            for name, p in adapted.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed + len(name)))
        adapters.append((spec, {k: v.detach().clone() for k, v in adapter_state_dict(adapted).items()}))
    group, max_tokens = (4, 8) if args.quick else (8, 32)
    shared, separate = generation_steps_per_s(config, base_sd, adapters, group, max_tokens, repeat)
    print(
        f"generation of a step of two LoRA runs: shared engine {shared:.2f}/s, an engine each {separate:.2f}/s"
    )
    emit(
        BENCH,
        "lora_shared_over_separate_generation_steps_per_s",
        shared,
        separate,
        shared / separate,
        "steps/s",
        ">= 1 (one base, both runs in one batch)",
    )
    if args.stack:
        stack_figures(args.quick)


if __name__ == "__main__":
    main()
