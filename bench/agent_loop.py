"""Agent loop: episodes/s with 16 concurrent episodes vs one at a time, same inference engine.

The measured path is the real EpisodeRunner (chat template, environment steps, token/log-prob
bookkeeping, reward scoring by the real verifier registry) over the embedded CPU engine with
continuous batching (services/inference_router/engine, the engine an embedded deployment runs),
called in-process. With --router ADDRESS it uses a running inference-router over gRPC instead.
Both modes run the same episodes against the same engine; only the concurrency differs.
"""

from __future__ import annotations

import asyncio
import json
import time

from bench.common import emit, parse_args
from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from services.environment_sandbox.agent_loop import (
    EpisodeRunner,
    Generator,
    ModelTurn,
    OneAtATime,
    RouterGenerator,
    Score,
)
from services.environment_sandbox.environments import generate_tasks
from services.modeling.tokenizer import CharTokenizer
from services.reward.registry import default_registry
from services.reward.verifiers import ScoreInput

CONCURRENCY = 16


def engine_generator():
    from bench.harness.local_fleet import tiny_checkpoint
    from services.inference_router.engine.base import EngineRequest, SamplingParams
    from services.inference_router.engine.cpu import CPUEngine

    config, weights = tiny_checkpoint(seed=0)
    engine = CPUEngine.create(config, weights, version=1, max_batch_size=32, max_model_len=256).start()

    async def generate(prompt_ids, sampling, session_id, min_weight_version) -> ModelTurn:
        request = EngineRequest(list(prompt_ids), SamplingParams.from_proto(sampling), session_id)
        result = (await engine.generate([request]))[0].completions[0]
        return ModelTurn(result.token_ids, result.logprobs, result.finish_reason, result.weight_version)

    return OneAtATime(generate), engine


async def main() -> None:
    args = parse_args(__doc__, lambda p: p.add_argument("--router", default="", help="router address"))
    n = 32 if args.quick else 96
    registry = default_registry()

    async def score(reward, task_json, completion, rollout_id, transcript, env_reward) -> Score:
        out = await registry.score(
            reward, ScoreInput(json.loads(task_json), completion, transcript, env_reward)
        )
        return Score(out.score, out.as_dict(), out.ok)

    engine = None
    if args.router:
        from services.kit.rpc.server import open_channel

        generate: Generator = RouterGenerator(open_channel(args.router))
    else:
        generate, engine = engine_generator()
    runner = EpisodeRunner(generate, score, CharTokenizer())
    sampling = common_pb2.SamplingParams(temperature=1.0, max_tokens=8)
    tasks = [
        events_pb2.EpisodeTask(
            run_id="bench",
            task_id=f"t{i}",
            group_id=f"g{i}",
            environment="digits",
            task_json=json.dumps(t),
            sampling=sampling,
        )
        for i, t in enumerate(generate_tasks("digits", n, seed=1))
    ]

    async def run_all(concurrency: int) -> float:
        gate = asyncio.Semaphore(concurrency)

        async def one(task):
            async with gate:
                return await runner.run(task)

        start = time.perf_counter()
        rollouts = await asyncio.gather(*(one(t) for t in tasks))
        assert len(rollouts) == n and all(r.turns[1].token_ids for r in rollouts)
        return n / (time.perf_counter() - start)

    await run_all(CONCURRENCY)  # warm-up (first touch of weights and caches)
    sequential = await run_all(1)
    concurrent = await run_all(CONCURRENCY)
    if engine is not None:
        await engine.close()
    mode = f"router {args.router}" if args.router else "embedded CPU engine (in-process)"
    print(f"inference: {mode}; {n} digits episodes, max_tokens 8")
    print(f"{'mode':<24}{'episodes/s':>12}")
    print(f"{'one at a time':<24}{sequential:>12.1f}")
    print(f"{f'{CONCURRENCY} concurrent':<24}{concurrent:>12.1f}")
    emit(
        "agent_loop",
        "concurrent_speedup",
        concurrent,
        sequential,
        concurrent / sequential,
        "episodes/s",
        ">= 3",
    )


if __name__ == "__main__":
    asyncio.run(main())
