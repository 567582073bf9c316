"""GPU probe of the vLLM weight path (run by tools/gpu_check.sh; needs CUDA and the vLLM environment).

Two vLLM deployments (tp=1 and tp=2 when two GPUs are visible, else two tp=1), each started with
no weights (load_format="dummy", like a deployment with no model path), then `--versions`
versions swapped in through looprl's vLLM weight-transfer backend, each version the previous one
plus a small update (an RL step's size), resharded per rank exactly as weight-sync plans it.
After each swap it prints:

- the swap's seconds (handoff to every worker, vLLM's pause/start/update/finish/reset/resume);
- the log-prob drift: mean |vLLM log-prob - trainer log-prob| over the tokens vLLM sampled, the
  trainer's log-probs from looprl's own Qwen2 forward on the same (bf16) weights, against the
  bound the canary uses (weight-sync's default canary_max_drift);
- generated tokens/s of a batch of sampled requests.

Exits non-zero when a swap fails or the drift exceeds the bound. Writes a JSON summary to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.kit.config.recipe import DeploymentSpec
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, shard_state_dict
from services.modeling.logprobs import token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM

CONFIG = ModelConfig.tiny(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
)
CANARY_BOUND = 0.5  # services/weight_sync/deliver.py: canary_max_drift's default (nats)


def _bf16_state(model: Qwen2ForCausalLM) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16) for k, v in model.hf_state_dict().items()}


def _step(model: Qwen2ForCausalLM, seed: int, scale: float = 2e-3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale * (p.std() + 1e-3))


def _trainer_logprobs(model: Qwen2ForCausalLM, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor(prompt + tokens)
    with torch.no_grad():
        logits = model(ids)
    return token_logprobs(logits, ids, torch.tensor([0, len(ids)]), 1.0)[len(prompt) :]


async def probe(tp: int, versions: int, batch: int, max_tokens: int) -> dict:
    from services.inference_router.engine.vllm_engine import VLLMEngine

    spec = DeploymentSpec(
        backend="vllm",
        tensor_parallel=tp,
        dtype="bfloat16",
        max_model_len=512,
        gpu_memory_utilization=0.12,
        enforce_eager=True,
    )
    trainer = Qwen2ForCausalLM(CONFIG, seed=0).eval()
    layout = Layout(tp, "fused", "bfloat16")
    started = time.perf_counter()
    engine = await VLLMEngine.create(CONFIG, spec)
    rows = []
    try:
        print(f"tp={tp}: vLLM up in {time.perf_counter() - started:.1f}s", flush=True)
        for version in range(1, versions + 1):
            if version > 1:
                _step(trainer, seed=version)
            state = _bf16_state(trainer)
            shards = [shard_state_dict(state, CONFIG, layout, r) for r in range(tp)]
            t0 = time.perf_counter()
            await engine.swap(version, shards)
            swap_s = time.perf_counter() - t0
            # the trainer's reference on exactly the weights served (bf16 values, fp32 compute)
            reference = Qwen2ForCausalLM(CONFIG, seed=0).eval()
            reference.load_hf_state_dict({k: v.float() for k, v in state.items()})
            prompts = [[(31 * i + 7 * j + 3) % CONFIG.vocab_size for j in range(24)] for i in range(batch)]
            requests = [
                EngineRequest(p, SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i))
                for i, p in enumerate(prompts)
            ]
            t0 = time.perf_counter()
            results = await engine.generate(requests)
            gen_s = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for r in results for c in r.completions)
            diffs = []
            for prompt, result in list(zip(prompts, results, strict=True))[:8]:
                comp = result.completions[0]
                assert set(comp.token_versions) == {version}, comp.token_versions
                ref = _trainer_logprobs(reference, prompt, comp.token_ids)
                diffs.append((torch.tensor(comp.logprobs) - ref).abs())
            drift = float(torch.cat(diffs).mean())
            row = {
                "tp": tp,
                "version": version,
                "swap_seconds": swap_s,
                "logprob_drift": drift,
                "tokens_per_second": tokens / gen_s,
            }
            rows.append(row)
            print(
                f"tp={tp} version {version}: weight swap {swap_s:.3f}s, log-prob drift trainer vs vLLM "
                f"{drift:.4f} nats (canary bound {CANARY_BOUND}), {tokens / gen_s:.0f} generated tokens/s",
                flush=True,
            )
    finally:
        await engine.close()
    return {"tp": tp, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default="reports/gpu-check/probe.json")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count()
    if gpus < 1:
        print("no CUDA GPU visible", file=sys.stderr)
        return 2
    tps = (1, 2) if gpus >= 2 else (1, 1)
    print(f"{gpus} GPU(s): deployments with tp={tps[0]} and tp={tps[1]}", flush=True)
    summary = [asyncio.run(probe(tp, args.versions, args.batch, args.max_tokens)) for tp in tps]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    worst = max(r["logprob_drift"] for s in summary for r in s["rows"])
    print(f"worst log-prob drift {worst:.4f} nats (bound {CANARY_BOUND}); summary in {args.out}")
    return 0 if worst <= CANARY_BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
