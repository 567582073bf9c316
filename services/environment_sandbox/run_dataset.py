"""A run's dataset in the environment-sandbox: rows read from a JSONL or parquet file (or a glob of
them), a Hugging Face `datasets` directory or a task source plugin; each mapped to a task (prompt or
chat messages, reference answer, metadata, every column as it is); left out, and counted, when the
prompt the environment renders from it is longer than the run's deployments serve; split into
training and held-out rows; visited in a seeded order, a new one each epoch.

The gateway publishes tasks as {"index", "seed", "split"} with the dataset section on the
EpisodeTask (`dataset_json`), so it never reads a row; every sandbox process maps an index to the
same row. A dataset is loaded once per process and run settings (`DatasetCache`).
"""

from __future__ import annotations

import asyncio
import glob
import json
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.environment_sandbox.environments import (
    EnvironmentError_,
    PluginFailure,
    environment_class,
    plugin_code,
)
from services.environment_sandbox.environments.base import parse_config
from services.environment_sandbox.environments.datasets import load_jsonl
from services.kit.config.recipe import DatasetSection
from services.kit.config.schema import explain
from services.kit.usercode import plugins

SPLITS = ("train", "eval")
ROLES = ("system", "user", "assistant", "tool")
# Rows measured between two yields to the event loop (about 25 ms of rendering and tokenizing).
YIELD_EVERY_ROWS = 256


class DatasetError(EnvironmentError_):
    """The dataset cannot be read or mapped; the message names the recipe field, the file and row."""


@dataclass
class RunDataset:
    """The tasks of a run, split and filtered."""

    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    rows: int
    filtered_too_long: int
    max_prompt_tokens: int
    longest_prompt_tokens: int
    sources: list[str]
    seed: int
    shuffle: bool
    source_field: str = "source"
    _orders: OrderedDict[int, list[int]] = field(default_factory=OrderedDict)

    def task(self, split: str, index: int) -> dict[str, Any]:
        """The index-th task of a split: held-out tasks in their order, training tasks in epoch
        index // len(train)'s seeded order."""
        if not isinstance(index, int) or index < 0:
            raise DatasetError(f"task_json.index: must be a non-negative integer, got {index!r}")
        if split == "eval":
            if index >= len(self.eval):
                raise DatasetError(f"task_json.index: {index} is past the {len(self.eval)} held-out rows")
            return self.eval[index]
        if split != "train":
            raise DatasetError(f"task_json.split: must be one of {', '.join(SPLITS)}, got {split!r}")
        epoch, position = divmod(index, len(self.train))
        return self.train[self._order(epoch)[position]]

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self.train)))
            if self.shuffle:
                random.Random(f"dataset:{self.seed}:epoch:{epoch}").shuffle(order)
            self._orders[epoch] = order
            while len(self._orders) > 4:
                self._orders.popitem(last=False)
        return order


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def _hf_directory(path: Path, split: str, field_name: str, given: str) -> list[dict[str, Any]]:
    """Rows of a `datasets` save_to_disk directory (a Dataset, or a DatasetDict's `split`), read with
    pyarrow as `datasets.load_from_disk` reads them: the Arrow stream files state.json lists, each
    of them a file of the directory."""
    import pyarrow as pa

    top = path
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits or not _inside((path / split).resolve(), [top]):
            raise DatasetError(f"dataset.split: {given!r} holds splits {', '.join(splits)}, not {split!r}")
        path = (path / split).resolve()
    state = path / "state.json"
    if state.is_file():
        names = [str(f.get("filename", "")) for f in json.loads(state.read_text()).get("_data_files", [])]
        files = [(path / name).resolve() for name in names]
        for name, file in zip(names, files, strict=True):
            if not (_inside(file, [top]) and file.is_file()):
                raise DatasetError(
                    f"{field_name}: {given!r}: state.json names {name!r}, not a file of the directory"
                )
    else:
        files = sorted(path.glob("*.arrow"))
    if not files:
        raise DatasetError(
            f"{field_name}: {given!r} is not a `datasets` directory (no state.json or .arrow files)"
        )
    rows: list[dict[str, Any]] = []
    for file in files:
        with pa.memory_map(str(file)) as source:
            rows += pa.ipc.open_stream(source).read_all().to_pylist()
    return rows


def _parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _confined(path_text: str, roots: Sequence[Path]) -> list[Path]:
    """What a dataset path names inside the data directories, symlinks and '..' resolved: the one
    file or directory, or a glob's matching files (its directory must be inside one). Empty when
    nothing there: a path outside them is not looked at, so it answers as a missing one."""
    parts = Path(path_text).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    base = Path(*parts[:fixed]) if fixed else Path(".")
    try:
        if not _inside(base.resolve(), roots):
            return []
        if fixed == len(parts):
            return [base.resolve()] if base.exists() else []
        matches = [Path(p).resolve() for p in sorted(glob.glob(path_text))]
        return [m for m in matches if _inside(m, roots) and m.is_file()]
    except (OSError, ValueError):  # a name no file can have (a NUL byte, too long)
        return []


def read_rows(
    path_text: str,
    format: str,
    split: str,
    field_name: str = "dataset.path",
    *,
    roots: Sequence[Path],
) -> list[dict[str, Any]]:
    """Every row of a file, a glob of files or a `datasets` directory, in order; only inside `roots`
    (the sandbox's data and plugin directories)."""
    files = _confined(path_text, roots)
    if len(files) == 1 and files[0].is_dir() and format in ("auto", "hf"):
        return _hf_directory(files[0], split, field_name, path_text)
    if not files or not all(f.is_file() for f in files):
        where = ", ".join(str(r) for r in roots) or "none configured: LOOPRL_DATA_DIRS"
        raise DatasetError(
            f"{field_name}: {path_text!r} does not exist in the data directories ({where}), "
            "or matches no file there"
        )
    if format == "hf":
        raise DatasetError(f"{field_name}: {path_text!r} is not a directory (format 'hf')")
    rows: list[dict[str, Any]] = []
    for file in files:
        kind = (
            format
            if format != "auto"
            else {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(file.suffix, "")
        )
        if kind == "jsonl":
            try:
                rows += list(load_jsonl(file))
            except EnvironmentError_ as exc:
                raise DatasetError(f"{field_name}: {exc}") from None
        elif kind == "parquet":
            try:
                rows += _parquet(file)
            except Exception as exc:  # pyarrow's own errors (not a parquet file, truncated)
                raise DatasetError(f"{field_name}: {file}: not readable as parquet: {exc}") from None
        else:
            raise DatasetError(
                f"{field_name}: {str(file)!r}: unknown file type {file.suffix!r} (.jsonl, .json, .parquet, "
                "or set dataset.format)"
            )
    return rows


def source_rows(spec: DatasetSection, dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """The rows a task source plugin returns."""
    loaded = plugins.load(spec.source, plugins.TASK_SOURCES_GROUP, dirs)
    if not callable(loaded.obj):
        raise plugins.PluginError(f"{spec.source!r} ({loaded.origin}) is not callable")
    try:
        rows = plugins.call_contained(loaded.obj, **spec.source_config)
        rows = plugins.call_contained(list, rows) if isinstance(rows, Iterable) else rows
    except Exception as exc:
        raise plugins.PluginError(f"{spec.source!r} failed: {plugins.describe(exc, loaded.root)}") from None
    if not isinstance(rows, list):
        raise plugins.PluginError(f"{spec.source!r} returned {type(rows).__name__}, not an iterable of dicts")
    return rows


def to_task(row: Any, spec: DatasetSection, where: str) -> dict[str, Any]:
    """The environment's task of one row: every column, plus `prompt` or `messages`, `answer` and
    `metadata` under their own names."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: a row must be an object (a table row), got {type(row).__name__}")
    # JSON-safe (dates, decimals and bytes as text): the task travels as JSON.
    task: dict[str, Any] = json.loads(json.dumps(row, default=str))
    messages = task.get(spec.messages_field)
    if messages is not None:
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise DatasetError(
                f"{where}.{spec.messages_field}: must be a non-empty list of {{role, content}} strings"
            )
        for i, m in enumerate(messages):
            if m["role"] not in ROLES:  # ShareGPT's human/gpt would render as roles no template knows
                raise DatasetError(
                    f"{where}.{spec.messages_field}[{i}].role: must be system, user, assistant or tool, "
                    f"got {m['role']!r}"
                )
        task["messages"] = messages
    elif isinstance(task.get(spec.prompt_field), str):
        task["prompt"] = task[spec.prompt_field]
    else:
        raise DatasetError(
            f"{where}: no prompt: needs a string {spec.prompt_field!r} or a list {spec.messages_field!r} "
            "(dataset.prompt_field, dataset.messages_field)"
        )
    if spec.answer_field in task:
        task["answer"] = task[spec.answer_field]
    prompt_columns = {
        spec.prompt_field,
        spec.messages_field,
        spec.answer_field,
        "prompt",
        "messages",
        "answer",
    }
    names = spec.metadata_fields or [k for k in row if k not in prompt_columns]
    missing = [n for n in names if n not in task]
    if missing:
        raise DatasetError(f"{where}: no column {missing[0]!r} (dataset.metadata_fields)")
    task["metadata"] = {n: task[n] for n in names}
    return task


async def prompt_lengths(
    environment: str, config_json: str | None, tasks: list[dict], tokenizer: Any
) -> list[int]:
    """Tokens of each task's opening prompt as the environment renders it with the run's chat
    template (what the replica is asked to prefill); a task the environment refuses names its row."""
    cls = environment_class(environment)
    env = cls(parse_config(cls, config_json))
    lengths = []
    for i, task in enumerate(tasks):
        if i % YIELD_EVERY_ROWS == YIELD_EVERY_ROWS - 1:
            await asyncio.sleep(0)  # a large dataset takes seconds: the loop's episodes go on meanwhile
        with plugin_code(cls, f"failed to reset on dataset task {i}"):
            observation = await env.reset(task)
        ids = tokenizer.apply_chat_template(observation, add_generation_prompt=True, tools=env.tool_schemas())
        lengths.append(len(ids))
    return lengths


async def load_dataset(
    spec: DatasetSection,
    seed: int,
    environment: str,
    config_json: str | None,
    tokenizer: Any,
    max_prompt_tokens: int,
    dirs: Sequence[Path],
    data_dirs: Sequence[Path] = (),
) -> RunDataset:
    """Read, map, filter and split a run's dataset: a task source from the plugin directories
    `dirs`, files only inside `data_dirs` and `dirs`."""
    roots = (*data_dirs, *dirs)
    if spec.source:
        raw = await asyncio.to_thread(source_rows, spec, dirs)
        label = spec.source
    else:
        raw = await asyncio.to_thread(read_rows, spec.path, spec.format, spec.split, roots=roots)
        label = spec.path
    held_raw: list = []
    if spec.eval_path:
        held_raw = await asyncio.to_thread(
            read_rows, spec.eval_path, spec.format, spec.split, "dataset.eval_path", roots=roots
        )
    if not raw:
        field_name = "dataset.source" if spec.source else "dataset.path"
        raise DatasetError(f"{field_name}: {label!r} holds no rows")
    tasks = [to_task(r, spec, f"dataset {label} row {i}") for i, r in enumerate(raw)]
    held = [to_task(r, spec, f"dataset.eval_path {spec.eval_path} row {i}") for i, r in enumerate(held_raw)]
    try:
        lengths = await prompt_lengths(environment, config_json, tasks + held, tokenizer)
    except PluginFailure:
        raise
    except EnvironmentError_ as exc:
        raise DatasetError(f"dataset: a row is not a task of environment {environment!r}: {exc}") from None
    limit = max_prompt_tokens or 1 << 62
    keep = [t for t, n in zip(tasks, lengths, strict=False) if n <= limit]
    keep_held = [t for t, n in zip(held, lengths[len(tasks) :], strict=True) if n <= limit]
    kept_lengths = [n for n in lengths if n <= limit]
    if spec.eval_size:
        if spec.eval_size >= len(keep):
            raise DatasetError(
                f"dataset.eval_size: {spec.eval_size} held out of {len(keep)} rows leaves none to train on"
            )
        order = list(range(len(keep)))
        random.Random(f"dataset:{seed}:held-out").shuffle(order)
        held_out = set(order[: spec.eval_size])
        keep_held = [keep[i] for i in sorted(held_out)]
        keep = [t for i, t in enumerate(keep) if i not in held_out]
    if not keep:
        raise DatasetError(
            f"dataset: none of the {len(tasks)} rows of {label} fits: every prompt is longer than "
            f"{max_prompt_tokens} tokens (dataset.max_prompt_tokens, the deployments' max_model_len)"
        )
    sources = sorted({str(t.get(spec.source_field, environment)) for t in keep + keep_held})
    return RunDataset(
        train=keep,
        eval=keep_held,
        rows=len(tasks) + len(held),
        filtered_too_long=len(tasks) + len(held) - len(kept_lengths),
        max_prompt_tokens=max_prompt_tokens,
        longest_prompt_tokens=max(kept_lengths, default=0),
        sources=sources,
        seed=seed,
        shuffle=spec.shuffle,
        source_field=spec.source_field,
    )


def parse_spec(dataset_json: str) -> tuple[DatasetSection, int, int]:
    """(section, seed, max_prompt_tokens) from an EpisodeTask's dataset_json."""
    try:
        data = json.loads(dataset_json)
        seed = int(data.pop("seed", 0))
        limit = int(data.pop("max_prompt_tokens_limit", 0))
        return DatasetSection.model_validate(data), seed, limit
    except (ValueError, TypeError) as exc:
        detail = explain(exc, DatasetSection) if hasattr(exc, "errors") else str(exc)
        raise DatasetError(f"dataset: {detail}") from None


class DatasetCache:
    """Loaded datasets of this process, by everything that decides their tasks (one load however
    many episodes ask at once)."""

    def __init__(
        self, plugin_dirs: Sequence[Path] = (), capacity: int = 8, data_dirs: Sequence[Path] = ()
    ) -> None:
        self.plugin_dirs = tuple(plugin_dirs)
        self.data_dirs = tuple(data_dirs)
        self.capacity = capacity
        self._loaded: OrderedDict[tuple, asyncio.Future] = OrderedDict()

    async def get(
        self,
        dataset_json: str,
        environment: str,
        config_json: str | None,
        tokenizer_spec: str,
        tokenizer: Any,
        refresh: bool = False,
    ) -> RunDataset:
        """The dataset, loaded on first use; `refresh` reads it again (a run being created: its files
        may have changed since another run used them)."""
        key = (dataset_json, environment, config_json or "", tokenizer_spec)
        future = self._loaded.get(key)
        if refresh or future is None or (future.done() and future.exception() is not None):
            spec, seed, limit = parse_spec(dataset_json)
            future = asyncio.ensure_future(
                load_dataset(
                    spec, seed, environment, config_json, tokenizer, limit, self.plugin_dirs, self.data_dirs
                )
            )
            self._loaded[key] = future
            while len(self._loaded) > self.capacity:
                self._loaded.popitem(last=False)
        self._loaded.move_to_end(key)
        return await asyncio.shield(future)
