"""Evaluation during a run: the held-out split generated and scored, and the figures recorded.

Every `eval.every` steps (and before training, and after the last step) the run's driver holds the
feed (no episode of a later step goes out, so no later version can be trained and the replicas
serve exactly the version evaluated), asks the environment-sandbox to play every held-out prompt
through RunEpisode (greedily and/or `eval.samples` times with the run's sampling settings), and
records pass@1, pass@k, mean reward and mean length, overall and per task source, in the run
record (`Run.evaluations`, the report, `looprl runs`, the gateway's metrics).

Evaluation episodes never train: RunEpisode publishes nothing, and an EpisodeTask marked
`evaluation` is refused by the episode queue. Their seeds follow from the run's seed and the prompt
alone (never the step), so `looprl eval RUN --step N` on the weights of step N samples the same
episodes as the run's own evaluation of step N.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import statistics
import time
from collections import defaultdict
from typing import Any

import grpc

from looprl.common.v1 import common_pb2
from looprl.environment.v1 import environment_pb2
from looprl.events.v1 import events_pb2
from looprl.gateway.v1 import gateway_pb2
from services.kit.config.recipe import Recipe, RunRecord, sampling_seed

log = logging.getLogger("looprl.gateway.evaluation")

# Held-out prompts of an environment without a dataset: generated from this index on, far past any
# index a run trains on, so they are tasks the run never sees.
GENERATED_EVAL_INDEX = 1 << 40
GENERATED_EVAL_PROMPTS = 64
# Evaluation samples draw from their own seed stream, apart from the training samples'.
EVAL_SEED_SALT = 0x5EED_E7A1
CONCURRENCY = 16
# How long an evaluation episode is retried while its sandbox or replica is not ready.
RETRY_S = 300.0
# Answers that retrying cannot change: the task or the run's code is at fault.
REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


def eval_versions(recipe: Recipe) -> list[int]:
    """The weight versions a training run evaluates: 0 (before_training), every k-th, the last."""
    return recipe.eval.versions(recipe.run.steps)


def prompt_count(recipe: Recipe, eval_rows: int) -> int:
    if recipe.dataset.enabled:
        return min(recipe.eval.prompts or eval_rows, eval_rows)
    return recipe.eval.prompts or GENERATED_EVAL_PROMPTS


def eval_tasks(
    record: RunRecord, recipe: Recipe, version: int, dataset_json: str, eval_rows: int
) -> list[tuple[int, events_pb2.EpisodeTask]]:
    """(prompt index, task) of one evaluation of weight `version`: per prompt a greedy task and/or
    one task forking into eval.samples seeded samples."""
    ev, env = recipe.eval, recipe.environment
    seed = recipe.run.seed
    common = {
        "run_id": record.run_id,
        "environment": env.name,
        "reward": recipe.reward_name,
        "reward_config_json": json.dumps(recipe.reward.config) if recipe.reward.config else "",
        "environment_config_json": json.dumps({**env.config, "max_turns": env.max_turns}),
        "tokenizer": recipe.model.tokenizer,
        "dataset_json": dataset_json,
        "min_weight_version": version,
        "step": version,
        "evaluation": True,
    }
    tasks = []
    for i in range(prompt_count(recipe, eval_rows)):
        if recipe.dataset.enabled:
            task_json = json.dumps({"index": i, "seed": seed, "split": "eval"})
        else:
            task_json = json.dumps({"index": GENERATED_EVAL_INDEX + i, "seed": seed})
        group = f"{record.run_id}.eval{version}.p{i}"
        base = common_pb2.SamplingParams(
            temperature=recipe.sampling.temperature,
            top_p=recipe.sampling.top_p,
            top_k=recipe.sampling.top_k,
            max_tokens=recipe.sampling.max_tokens,
            n=1,
        )
        if ev.greedy:
            greedy = common_pb2.SamplingParams(max_tokens=recipe.sampling.max_tokens, temperature=0.0, n=1)
            tasks.append(
                (
                    i,
                    events_pb2.EpisodeTask(
                        task_id=f"{group}.greedy",
                        group_id=group,
                        task_json=task_json,
                        sampling=greedy,
                        group_size=1,
                        **common,
                    ),
                )
            )
        if ev.samples:
            base.seed = sampling_seed(seed ^ EVAL_SEED_SALT, i)
            tasks.append(
                (
                    i,
                    events_pb2.EpisodeTask(
                        task_id=f"{group}.samples",
                        group_id=group,
                        task_json=task_json,
                        sampling=base,
                        group_size=1,
                        sample_index=0,
                        branches=ev.samples if ev.samples > 1 else 0,
                        **common,
                    ),
                )
            )
    return tasks


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c pass (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _figures(rows: list[dict], recipe: Recipe) -> dict[str, float]:
    greedy = [r for r in rows if r["greedy"]]
    sampled: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        if not r["greedy"]:
            sampled[r["prompt"]].append(r)
    k = recipe.eval.samples
    passes = [pass_at_k(len(s), sum(x["passed"] for x in s), min(k, len(s))) for s in sampled.values() if s]
    if greedy:
        pass1 = statistics.fmean(r["passed"] for r in greedy)
    else:
        pass1 = statistics.fmean(pass_at_k(len(s), sum(x["passed"] for x in s), 1) for s in sampled.values())
    return {
        "prompts": len({r["prompt"] for r in rows}),
        "pass_at_1": pass1,
        "pass_at_k": statistics.fmean(passes) if passes else 0.0,
        "mean_reward": statistics.fmean(r["reward"] for r in rows),
        "mean_response_tokens": statistics.fmean(r["tokens"] for r in rows),
    }


def summarize(rows: list[dict], recipe: Recipe, step: int, seconds: float) -> dict[str, Any]:
    """The recorded figures of one evaluation from its episodes' rows (prompt, source, greedy,
    reward, passed, tokens)."""
    by_source: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_source[r["source"]].append(r)
    return {
        "step": step,
        "samples_per_prompt": recipe.eval.samples,
        "k": recipe.eval.samples,
        "greedy": recipe.eval.greedy,
        **_figures(rows, recipe),
        "sources": {name: _figures(group, recipe) for name, group in sorted(by_source.items())},
        "seconds": seconds,
        "unix_time": time.time(),
    }


def _row(prompt: int, task: events_pb2.EpisodeTask, rollout: Any, recipe: Recipe, source: str) -> dict:
    return {
        "prompt": prompt,
        "source": source,
        "greedy": task.sampling.temperature == 0.0,
        "reward": rollout.reward,
        "passed": rollout.reward >= recipe.eval.pass_threshold,
        "tokens": sum(len(t.token_ids) for t in rollout.turns if t.trainable),
    }


async def _run_episode(sandbox: Any, task: events_pb2.EpisodeTask, timeout_s: float) -> list[Any]:
    """The task's rollouts from RunEpisode. A refusal (a bad task, a broken plugin) raises at once; a
    sandbox or replica not ready yet (restarting, still loading the version) is asked again for up to
    RETRY_S."""
    deadline = time.monotonic() + RETRY_S
    delay = 0.5
    while True:
        try:
            reply = await sandbox.RunEpisode(environment_pb2.RunEpisodeRequest(task=task), timeout=timeout_s)
            return list(reply.rollouts) or [reply.rollout]
        except grpc.aio.AioRpcError as exc:
            if exc.code() in REFUSALS or time.monotonic() > deadline:
                raise EvaluationFailed(
                    f"evaluation episode {task.task_id}: {exc.code().name}: {exc.details()}"
                ) from None
            log.warning("evaluation episode %s: %s; again in %.1fs", task.task_id, exc.code().name, delay)
        await asyncio.sleep(delay)
        delay = min(2 * delay, 10.0)


class EvaluationFailed(RuntimeError):
    """An evaluation could not be run; the message says which episode and why."""


async def evaluate(
    sandbox: Any,
    record: RunRecord,
    recipe: Recipe,
    version: int,
    step: int,
    dataset_json: str,
    eval_rows: int,
    on_episode: Any = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Evaluate weight `version` (recorded as `step`) on the held-out split; the figures to record."""
    started = time.monotonic()
    tasks = eval_tasks(record, recipe, version, dataset_json, eval_rows)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(prompt: int, task: events_pb2.EpisodeTask) -> list[dict]:
        async with gate:
            rollouts = await _run_episode(sandbox, task, timeout_s)
        if on_episode is not None:
            on_episode()
        source = rollouts[0].task_source or recipe.environment.name
        return [_row(prompt, task, r, recipe, source) for r in rollouts]

    rows = [row for group in await asyncio.gather(*(one(p, t) for p, t in tasks)) for row in group]
    return summarize(rows, recipe, step, time.monotonic() - started)


def evaluation_to_proto(figures: dict[str, Any]) -> gateway_pb2.Evaluation:
    """A recorded evaluation as the public Run shows it."""
    fields = gateway_pb2.Evaluation.DESCRIPTOR.fields_by_name
    source_fields = gateway_pb2.EvaluationSource.DESCRIPTOR.fields_by_name
    out = gateway_pb2.Evaluation(**{k: v for k, v in figures.items() if k in fields and k != "sources"})
    for name, group in figures.get("sources", {}).items():
        out.sources[name].CopyFrom(
            gateway_pb2.EvaluationSource(**{k: v for k, v in group.items() if k in source_fields})
        )
    return out
