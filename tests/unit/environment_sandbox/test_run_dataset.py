"""A run's dataset as the environment-sandbox reads it: JSONL, parquet and `datasets` directories
give the same tasks, fields map to prompt/messages/answer/metadata, prompts too long to serve are
left out and counted, the held-out split is apart from training, and epochs visit every row in a
seeded order of their own."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.environment_sandbox.run_dataset import DatasetCache, DatasetError, load_dataset, read_rows
from services.kit.config.recipe import DatasetSection
from services.modeling.tokenizer import CharTokenizer

ROWS = [
    {"prompt": f"rev {i:03d}", "answer": f"{i:03d}"[::-1], "source": "a" if i % 2 else "b"} for i in range(40)
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def _load(spec: DatasetSection, environment: str = "single_turn", limit: int = 0, seed: int = 3):
    roots = [Path(p).parent for p in (spec.path, spec.eval_path) if p]
    return await load_dataset(spec, seed, environment, None, CharTokenizer(), limit, (), data_dirs=roots)


def test_jsonl_parquet_and_a_datasets_directory_read_the_same_rows(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    _jsonl(tmp_path / "train.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "train.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:3])}
    ).save_to_disk(str(tmp_path / "dict"))
    assert read_rows(str(tmp_path / "train.jsonl"), "auto", "train", roots=(tmp_path,)) == ROWS
    assert read_rows(str(tmp_path / "train.parquet"), "auto", "train", roots=(tmp_path,)) == ROWS
    # The directory reads as `datasets.load_from_disk` reads it, without importing `datasets`.
    assert read_rows(str(tmp_path / "saved"), "auto", "train", roots=(tmp_path,)) == list(
        datasets.load_from_disk(str(tmp_path / "saved"))
    )
    assert read_rows(str(tmp_path / "dict"), "hf", "test", roots=(tmp_path,)) == ROWS[:3]
    # load_dataset("parquet", data_files=...) offline: a glob of files, in order.
    pq.write_table(pa.Table.from_pylist(ROWS[:10]), tmp_path / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[10:]), tmp_path / "part-1.parquet")
    assert read_rows(str(tmp_path / "part-*.parquet"), "auto", "train", roots=(tmp_path,)) == ROWS
    with pytest.raises(DatasetError, match=r"dataset.split: .* holds splits train, test, not 'val'"):
        read_rows(str(tmp_path / "dict"), "auto", "val", roots=(tmp_path,))
    with pytest.raises(DatasetError, match=r"dataset.path: .*missing.jsonl' does not exist"):
        read_rows(str(tmp_path / "missing.jsonl"), "auto", "train", roots=(tmp_path,))


def test_bad_rows_are_refused_naming_the_file_and_row(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: not valid JSON"):
        read_rows(str(path), "auto", "train", roots=(tmp_path,))


async def test_fields_map_to_prompt_messages_answer_and_metadata(tmp_path: Path) -> None:
    rows = [
        {"question": "rev 12", "gold": "21", "level": 1},
        {
            "chat": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "rev 34"}],
            "gold": "43",
            "level": 2,
        },
    ]
    spec = DatasetSection(
        path=str(_jsonl(tmp_path / "d.jsonl", rows)),
        prompt_field="question",
        messages_field="chat",
        answer_field="gold",
        shuffle=False,
    )
    data = await _load(spec)
    first, second = data.task("train", 0), data.task("train", 1)
    assert first["prompt"] == "rev 12" and first["answer"] == "21" and first["metadata"] == {"level": 1}
    assert second["messages"][1]["content"] == "rev 34" and second["answer"] == "43"
    spec = spec.model_copy(update={"prompt_field": "nope", "messages_field": "none"})
    with pytest.raises(DatasetError, match=r"row 0: no prompt: needs a string 'nope' or a list 'none'"):
        await _load(spec)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([], "dataset.path: '{path}' holds no rows"),
        ([{"messages": []}], "row 0.messages: must be a non-empty list of {role, content} strings"),
        (
            [ROWS[0], {"messages": [{"from": "human", "value": "rev 12"}]}],
            "row 1.messages: must be a non-empty list of {role, content} strings",
        ),
        (
            [{"messages": [{"role": "human", "content": "rev 12"}]}],
            "row 0.messages[0].role: must be system, user, assistant or tool, got 'human'",
        ),
    ],
)
async def test_a_dataset_without_rows_or_with_rows_no_template_renders_is_refused_naming_them(
    tmp_path: Path, rows: list, message: str
) -> None:
    path = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError) as refused:
        await _load(DatasetSection(path=str(path)))
    assert message.replace("{path}", str(path)) in str(refused.value)


async def test_too_long_prompts_are_left_out_and_counted(tmp_path: Path) -> None:
    rows = [*ROWS[:10], {"prompt": "x" * 200, "answer": "1"}, {"prompt": "y" * 300, "answer": "2"}]
    data = await _load(DatasetSection(path=str(_jsonl(tmp_path / "d.jsonl", rows))), limit=64)
    assert data.rows == 12 and data.filtered_too_long == 2 and len(data.train) == 10
    assert 0 < data.longest_prompt_tokens <= 64
    assert all(len(t["prompt"]) < 100 for t in data.train)
    with pytest.raises(DatasetError, match=r"none of the 2 rows .* longer than 8 tokens"):
        await _load(DatasetSection(path=str(_jsonl(tmp_path / "e.jsonl", rows[10:]))), limit=8)


async def test_held_out_rows_never_train_and_epochs_shuffle_by_seed(tmp_path: Path) -> None:
    spec = DatasetSection(path=str(_jsonl(tmp_path / "d.jsonl", ROWS)), eval_size=8)
    data = await _load(spec)
    held = {t["prompt"] for t in data.eval}
    train = {t["prompt"] for t in data.train}
    assert len(held) == 8 and len(train) == 32 and not held & train
    assert data.sources == ["a", "b"]
    epoch0 = [data.task("train", i)["prompt"] for i in range(32)]
    epoch1 = [data.task("train", i)["prompt"] for i in range(32, 64)]
    assert set(epoch0) == set(epoch1) == train and epoch0 != epoch1  # every row once per epoch
    again = await _load(spec)
    assert [again.task("train", i)["prompt"] for i in range(64)] == epoch0 + epoch1  # same seed, same order
    other = await _load(spec, seed=4)
    assert [other.task("train", i)["prompt"] for i in range(32)] != epoch0
    with pytest.raises(DatasetError, match=r"past the 8 held-out rows"):
        data.task("eval", 8)


async def test_a_separate_held_out_file(tmp_path: Path) -> None:
    spec = DatasetSection(
        path=str(_jsonl(tmp_path / "t.jsonl", ROWS[:30])),
        eval_path=str(_jsonl(tmp_path / "e.jsonl", ROWS[30:])),
    )
    data = await _load(spec)
    assert len(data.train) == 30 and [t["prompt"] for t in data.eval] == [r["prompt"] for r in ROWS[30:]]


async def test_a_task_source_plugin_gives_the_rows(tmp_path: Path) -> None:
    (tmp_path / "tasks.py").write_text(
        "def make(count=3, op='rev'):\n    return ({'prompt': f'{op} {i}', 'answer': str(i)} for i in range(count))\n"
    )
    spec = DatasetSection(source="tasks.py:make", source_config={"count": 5})
    data = await load_dataset(spec, 0, "single_turn", None, CharTokenizer(), 0, (tmp_path,))
    assert data.rows == 5 and {t["prompt"] for t in data.train} == {f"rev {i}" for i in range(5)}


async def test_the_cache_loads_a_dataset_once_for_concurrent_episodes(tmp_path: Path) -> None:
    import asyncio

    spec = DatasetSection(path=str(_jsonl(tmp_path / "d.jsonl", ROWS)))
    text = json.dumps({**spec.model_dump(), "seed": 1})
    cache = DatasetCache(data_dirs=(tmp_path,))
    loaded = await asyncio.gather(
        *(cache.get(text, "single_turn", None, "char", CharTokenizer()) for _ in range(5))
    )
    assert all(d is loaded[0] for d in loaded)
    assert (await cache.get(text, "single_turn", None, "char", CharTokenizer(), refresh=True)) is not loaded[
        0
    ]


def test_a_path_outside_the_data_directories_answers_as_a_missing_one(tmp_path: Path) -> None:
    """A recipe's dataset.path reads only the operator's data directories: another tenant's data, or
    any JSON file of the sandbox's host, would otherwise become prompts the recipe's owner reads back
    in samples; and a missing file and a forbidden one answer alike (no oracle of the host's files)."""
    data = tmp_path / "data"
    data.mkdir()
    _jsonl(data / "mine.jsonl", ROWS[:2])
    secret = _jsonl(tmp_path / "secret.jsonl", [{"prompt": "someone else's row"}])
    (data / "link.jsonl").symlink_to(secret)
    pq.write_table(pa.Table.from_pylist(ROWS[:2]), tmp_path / "outside.parquet")
    roots = (data,)
    assert read_rows(str(data / "mine.jsonl"), "auto", "train", roots=roots) == ROWS[:2]
    answers = []
    for given in (
        str(secret),
        str(data / ".." / "secret.jsonl"),
        str(data / "link.jsonl"),
        str(tmp_path / "*.jsonl"),  # a glob whose directory is outside
        str(tmp_path / "outside.parquet"),
        str(tmp_path / "missing.jsonl"),
        str(data / "missing.jsonl"),
        str(data / "nul\x00.jsonl"),  # a name no file can have
    ):
        with pytest.raises(DatasetError) as caught:
            read_rows(given, "auto", "train", roots=roots)
        answers.append(str(caught.value).replace(repr(given)[1:-1], "PATH"))
    assert len(set(answers)) == 1, answers
    assert "does not exist in the data directories" in answers[0]
    # Inside, a glob leaves out what a symlink leads out to.
    assert read_rows(str(data / "*.jsonl"), "auto", "train", roots=roots) == ROWS[:2]


def test_a_datasets_directory_reads_only_its_own_files(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS[:2]).save_to_disk(str(tmp_path / "saved"))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "elsewhere.arrow")
    state = tmp_path / "saved" / "state.json"
    listing = json.loads(state.read_text())
    listing["_data_files"] = [{"filename": "../elsewhere.arrow"}]
    state.write_text(json.dumps(listing))
    with pytest.raises(
        DatasetError, match=r"dataset.path: .*state.json names '../elsewhere.arrow', not a file of"
    ):
        read_rows(str(tmp_path / "saved"), "auto", "train", roots=(tmp_path,))


async def test_measuring_a_large_dataset_leaves_the_event_loop_to_the_episodes_now_and_then() -> None:
    """The sandbox measures every row's prompt when a run is created (0.1 ms a row, seconds for a
    large dataset): the episodes of other runs on the same event loop must go on meanwhile."""
    import asyncio

    from services.environment_sandbox.run_dataset import prompt_lengths

    ticks = 0

    async def episode() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(episode())
    await asyncio.sleep(0)
    before = ticks
    tasks = [{"prompt": f"rev {i}", "answer": str(i)[::-1]} for i in range(4096)]
    lengths = await prompt_lengths("single_turn", None, tasks, CharTokenizer())
    other.cancel()
    assert len(lengths) == 4096
    assert ticks - before >= 8, (
        f"the loop ran other work {ticks - before} times while 4096 rows were measured"
    )
