"""CPU engine throughput: continuous batching of 16 concurrent requests vs the same requests one by one.

Both runs use the same engine (services/inference_router/engine/cpu.py) on the same small Qwen2
(hidden 256, 4 layers, fp32), the same prompts and the same sampling (seeded, fixed length so both
generate exactly the same number of tokens). The baseline sends each request only after the
previous one finished, so every decode step carries one sequence; the measured run submits all 16
at once and the scheduler decodes them together. Figure: tokens_per_s_ratio (target >= 3x).
"""

from __future__ import annotations

import asyncio
import time

import torch

from bench.common import emit, parse_args
from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.engine.cpu import CPUEngine
from services.modeling.config import ModelConfig
from services.modeling.qwen2 import Qwen2ForCausalLM


def make_requests(n: int, prompt_len: int, max_tokens: int, vocab: int) -> list[EngineRequest]:
    gen = torch.Generator().manual_seed(0)
    return [
        EngineRequest(
            torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(),
            # No stop tokens: every request generates exactly max_tokens in both runs.
            SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=1000 + i),
            request_id=f"req-{i}",
        )
        for i in range(n)
    ]


async def run(quick: bool) -> None:
    torch.set_num_threads(1)  # one core each way: the comparison is scheduling, not thread count
    config = ModelConfig.tiny(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=512,
    )
    model = Qwen2ForCausalLM(config, seed=0)
    engine = CPUEngine.create(config, model.hf_state_dict(), 0, max_batch_size=16, max_model_len=256)
    n, prompt_len, max_tokens = 16, 24, (16 if quick else 48)
    requests = make_requests(n, prompt_len, max_tokens, config.vocab_size)
    try:
        await engine.generate(make_requests(4, prompt_len, 4, config.vocab_size))  # warm-up

        start = time.perf_counter()
        sequential = [(await engine.generate([r]))[0] for r in requests]
        seq_s = time.perf_counter() - start

        start = time.perf_counter()
        batched = await engine.generate(requests)
        batch_s = time.perf_counter() - start
    finally:
        await engine.close()

    tokens = sum(len(r.completions[0].token_ids) for r in batched)
    assert tokens == sum(len(r.completions[0].token_ids) for r in sequential) == n * max_tokens
    # Seeded sampling does not depend on batch neighbours: both runs sample the same tokens.
    same = sum(
        a.completions[0].token_ids == b.completions[0].token_ids
        for a, b in zip(sequential, batched, strict=True)
    )
    seq_tps, batch_tps = tokens / seq_s, tokens / batch_s
    print(f"{'mode':<24}{'requests':>9}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}")
    print(f"{'one after another':<24}{n:>9}{tokens:>8}{seq_s:>9.2f}{seq_tps:>10.1f}")
    print(f"{'continuous batching':<24}{n:>9}{tokens:>8}{batch_s:>9.2f}{batch_tps:>10.1f}")
    print(f"identical completions (seeded): {same}/{n}")
    emit(
        "engine_batching", "tokens_per_s_ratio", batch_tps, seq_tps, batch_tps / seq_tps, "tokens/s", ">= 3x"
    )


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    asyncio.run(run(args.quick))


if __name__ == "__main__":
    main()
