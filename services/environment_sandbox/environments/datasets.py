"""Task sources: each environment's seeded generator, and local JSONL / parquet files.

A task source yields task dicts (the environment's task JSON). Generators are deterministic for a
seed, so a run can be reproduced and a test can name the exact tasks it expects.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.environment_sandbox.environments.base import EnvironmentError_, environment_class, parse_config


def generate_tasks(
    environment: str, count: int, seed: int = 0, config_json: str | dict | None = None
) -> list[dict]:
    cls = environment_class(environment)
    config = parse_config(cls, config_json)
    rng = random.Random(seed)
    return [cls.generate(rng, config) for _ in range(count)]


INDEX_KEYS = frozenset({"index", "seed", "split"})


def is_index_task(task: dict[str, Any]) -> bool:
    """True for a task that only names a dataset position ({"index", "seed"}, and the split of a
    recipe's dataset), as the gateway publishes them."""
    return "index" in task and set(task) <= INDEX_KEYS


def task_by_index(environment: str, index: int, seed: int = 0, config_json: str | dict | None = None) -> dict:
    """The index-th task of a run's generated dataset, the same in every process that asks.

    The gateway publishes {"index", "seed"} so it never imports environment code; the episode
    worker resolves the prompt (and its reference answer) here.
    """
    if not isinstance(index, int) or index < 0:
        raise EnvironmentError_(f"task_json.index: must be a non-negative integer, got {index!r}")
    cls = environment_class(environment)
    config = parse_config(cls, config_json)
    return cls.generate(random.Random(f"{environment}:{seed}:{index}"), config)


def load_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Tasks from a local JSONL file, one JSON object per line; errors name the line."""
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EnvironmentError_(f"{path}:{lineno}: not valid JSON: {exc}") from None
            if not isinstance(task, dict):
                raise EnvironmentError_(f"{path}:{lineno}: each line must be a JSON object")
            yield task


def load_parquet(path: str | Path) -> Iterator[dict[str, Any]]:
    """Tasks from a local parquet file (needs pyarrow, or the Hugging Face `datasets` library)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        try:
            from datasets import load_dataset
        except ImportError:
            raise EnvironmentError_(f"{path}: reading parquet needs pyarrow or datasets installed") from None
        yield from load_dataset("parquet", data_files=str(path), split="train")
        return
    yield from pq.read_table(path).to_pylist()


def load_tasks(path: str | Path) -> Iterator[dict[str, Any]]:
    suffix = Path(path).suffix
    if suffix in (".jsonl", ".json"):
        return load_jsonl(path)
    if suffix == ".parquet":
        return load_parquet(path)
    raise EnvironmentError_(f"{path}: unsupported task file type {suffix!r} (use .jsonl or .parquet)")
