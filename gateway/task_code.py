"""A run's task code and data, loaded by the services that run them before the run exists.

At CreateRun the gateway asks the environment-sandbox to load the run's environment (built in, or a
plugin named by import path or entry point), check its config against the environment's schema,
read, map, filter and split its dataset and try one reset (LoadEnvironment), and the reward
service to load its reward, check its settings against the function's own parameters and score one
trial task (LoadReward). A plugin that fails to import, to validate or to score refuses the run
at once, naming the recipe field, the plugin, its file and line; nothing is created. The gateway
itself never imports user code and never reads a dataset row.

What they answer goes into the run record: the dataset section episode tasks carry
(`dataset_json`, its path as the services open it) and the dataset's counts (rows, held out,
left out as too long), which the run's report and `Run.dataset` show.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc

from looprl.environment.v1 import environment_pb2
from looprl.reward.v1 import reward_pb2
from services.kit.config.recipe import Recipe
from services.kit.rpc.errors import FailedPrecondition, InvalidArgument

# RunRecord.extra keys: the dataset section as episode tasks carry it, and what the sandbox counted.
DATASET_JSON_KEY = "dataset_json"
DATASET_KEY = "dataset"
# A plugin that loads, validates and scores in more than this is refused: a run must fail fast.
LOAD_TIMEOUT_S = 8.0
# A dataset is read, mapped and measured row by row when the run is created (about 0.1 ms a row on
# one core): a large one takes longer than an import may. The sandbox holds the environment's
# import to its own deadline (IMPORT_TIMEOUT_S), so a hanging import is still refused at once.
DATASET_LOAD_TIMEOUT_S = 300.0


def _service_path(value: str, base_dir: Path) -> str:
    """A recipe's local path as the services open it: relative to the gateway's recipe directory when
    it exists there, else as given (relative to the services' working directory)."""
    if not value:
        return value
    path = Path(value)
    if path.is_absolute():
        return value
    candidate = base_dir / path
    parent = candidate.parent
    if candidate.exists() or (parent.is_dir() and any(parent.glob(path.name))):
        return str(candidate.resolve())
    return value


def dataset_json(recipe: Recipe, base_dir: Path) -> str:
    """The dataset section as episode tasks carry it (paths resolved, the run's seed and prompt
    limit added); empty without a dataset."""
    section = recipe.dataset
    if not section.enabled:
        return ""
    data = section.model_dump()
    data["path"] = _service_path(section.path, base_dir)
    data["eval_path"] = _service_path(section.eval_path, base_dir)
    data["seed"] = recipe.run.seed
    data["max_prompt_tokens_limit"] = recipe.max_prompt_tokens
    return json.dumps(data, sort_keys=True)


def _refusal(
    service: str,
    what: str,
    exc: grpc.aio.AioRpcError,
    given: dict[str, str] | None = None,
    timeout_s: float = LOAD_TIMEOUT_S,
) -> Exception:
    """The service's refusal as the gateway's own status, its message kept (it names the field), with
    the paths this gateway resolved named as the recipe gave them (`given`): whether a file exists on
    the gateway's host, and where the gateway runs, are not the recipe's to learn."""
    code, details = exc.code(), exc.details() or ""
    for resolved, value in (given or {}).items():
        details = details.replace(resolved, value)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return FailedPrecondition(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return FailedPrecondition(
            f"{what}: the {service} did not load it within {timeout_s:g}s (a hanging import, or a "
            "dataset too large to read in that time?)"
        )
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return FailedPrecondition(details)
    return FailedPrecondition(f"{service} cannot load {what}: {code.name}: {details}")


async def load_task_code(recipe: Recipe, peers: Any, base_dir: Path) -> dict[str, Any]:
    """Have the services load and check the run's environment, dataset and reward; the record
    entries the run keeps of it. Services the gateway has no address for are not asked."""
    extra: dict[str, Any] = {}
    env = recipe.environment
    data_json = dataset_json(recipe, base_dir)
    if data_json:
        extra[DATASET_JSON_KEY] = data_json
    first_task, first_answer, default_reward = "", "", ""
    if peers.sandbox is not None:
        timeout_s = DATASET_LOAD_TIMEOUT_S if data_json else LOAD_TIMEOUT_S
        try:
            reply = await peers.sandbox.LoadEnvironment(
                environment_pb2.LoadEnvironmentRequest(
                    environment=env.name,
                    environment_config_json=json.dumps({**env.config, "max_turns": env.max_turns}),
                    dataset_json=data_json,
                    tokenizer=recipe.model.tokenizer,
                    max_prompt_tokens=min(recipe.max_prompt_tokens, 2**31 - 1),
                ),
                timeout=timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            given = {
                _service_path(value, base_dir): value
                for value in (recipe.dataset.path, recipe.dataset.eval_path)
                if value and _service_path(value, base_dir) != value
            }
            raise _refusal("environment-sandbox", "environment.name", exc, given, timeout_s) from None
        first_task, first_answer = reply.first_task_json, reply.first_answer
        default_reward = reply.environment.default_reward
        if data_json:
            d = reply.dataset
            extra[DATASET_KEY] = {
                "rows": d.rows,
                "train_rows": d.train_rows,
                "eval_rows": d.eval_rows,
                "filtered_too_long": d.filtered_too_long,
                "max_prompt_tokens": d.max_prompt_tokens,
                "longest_prompt_tokens": d.longest_prompt_tokens,
                "sources": list(d.sources),
            }
            _check_rows(recipe, d.train_rows, d.eval_rows)
    reward = recipe.reward_name or default_reward
    if peers.reward is not None and reward:
        trials = []
        if first_task:
            for completion in dict.fromkeys(["", first_answer]):
                trials.append(
                    reward_pb2.ScoreRequest(reward=reward, task_json=first_task, completion=completion)
                )
        request = reward_pb2.LoadRewardRequest(
            reward=reward,
            config_json=json.dumps(recipe.reward.config) if recipe.reward.config else "",
            trials=trials,
        )
        field = "reward.function" if recipe.reward.function else "environment.reward"
        try:
            await peers.reward.LoadReward(request, timeout=LOAD_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise FailedPrecondition(f"{field}: {exc.details()}") from None
            raise _refusal("reward service", field, exc) from None
    return extra


def _check_rows(recipe: Recipe, train_rows: int, eval_rows: int) -> None:
    """A run that needs more prompts than its epochs allow, or evaluates without held-out rows."""
    needed = recipe.run.steps * recipe.groups_per_step
    epochs = recipe.dataset.epochs
    if epochs and needed > epochs * train_rows:
        raise FailedPrecondition(
            f"dataset.epochs: run.steps {recipe.run.steps} x {recipe.groups_per_step} prompts a step = "
            f"{needed} prompts, more than {epochs} epoch(s) of {train_rows} training rows"
        )
    if recipe.eval.enabled and eval_rows == 0:
        raise FailedPrecondition(
            "eval: the dataset holds no held-out rows to evaluate on (set dataset.eval_size or dataset.eval_path)"
        )
