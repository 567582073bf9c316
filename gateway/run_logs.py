"""The logs practitioners read: every scalar of a run and its samples tables, written as the run goes
by the client that follows it (`looprl run`, `looprl watch`) into the run's report directory.

Loggers (the recipe's `logging.logger`): `tensorboard` (event files under `<dir>/tensorboard`,
written with tensorboardX, read by TensorBoard itself), `mlflow` (a run in
`logging.mlflow_tracking_uri`, or a file store `<dir>/mlruns`), `jsonl` (`<dir>/metrics.jsonl`, one
line per step, and `<dir>/samples.jsonl`, one line per sample). The scalars are
`gateway.report.scalars(run)`: every number of the run's history, so everything the report plots
and whatever the history gains later. Each samples table also goes to TensorBoard's text panel and to
an MLflow table artifact (`samples/step_<step>.json`).

Why the client, not the gateway: the client runs where the user reads (its working directory, its
own MLflow credentials), while a gateway serving many tenants must neither write paths nor call
URIs a recipe names; and a slow tracking server then slows nobody's run. Nothing is lost when the
client is not there: the run keeps its whole history, and `looprl watch RUN` writes what a logger
has not written yet, by the progress each keeps in `<dir>/logged.json`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from gateway.progress import STATE_NAMES
from gateway.report import samples_markdown, scalars
from looprl.gateway.v1 import gateway_pb2
from services.kit.config.limits import RecipeLimits
from services.kit.config.recipe import LoggingSection, RecipeError, parse_recipe

STATE_FILE = "logged.json"
TENSORBOARD_DIR = "tensorboard"
METRICS_JSONL = "metrics.jsonl"
SAMPLES_JSONL = "samples.jsonl"
MLFLOW_DIR = "mlruns"
# The MLflow tag naming the looprl run an MLflow run logs (found again by `looprl watch`).
MLFLOW_RUN_TAG = "looprl.run_id"
SAMPLES_TAG = "samples"

Points = dict[str, list[tuple[int, float]]]
Tables = dict[int, list[gateway_pb2.SampleCompletion]]


class Sink(Protocol):
    name: str

    def write(self, points: Points, tables: Tables) -> None: ...

    def close(self, run: gateway_pb2.Run) -> None: ...


class MissingDependency(RuntimeError):
    """A logger the recipe names needs a package this environment lacks."""


def check_available(loggers: list[str]) -> None:
    """Raise MissingDependency, naming the install command, for a logger that cannot run here."""
    if "mlflow" in loggers:
        try:
            import mlflow  # noqa: F401
        except ImportError as exc:
            raise MissingDependency(
                "logging.logger: 'mlflow' needs the MLflow client here: "
                "pip install -c requirements.lock -e '.[mlflow]'"
            ) from exc


def logging_of(run: gateway_pb2.Run) -> LoggingSection:
    """The run's logging section (the defaults for a recipe this client cannot read)."""
    try:
        return parse_recipe(run.recipe_toml, limits=RecipeLimits.ceilings()).logging
    except RecipeError:
        return LoggingSection()


class TensorBoardSink:
    """Event files written synchronously (tensorboardX's record writer and summary protos, without
    its writer thread): a point counts as logged only once it is on disk."""

    name = "tensorboard"

    def __init__(self, directory: Path) -> None:
        from tensorboardX.event_file_writer import EventsWriter

        (directory / TENSORBOARD_DIR).mkdir(parents=True, exist_ok=True)
        # A follower that takes over later writes a file of its own beside the first's (TensorBoard
        # reads them all); the default name alone would be the same within a second.
        self.writer = EventsWriter(str(directory / TENSORBOARD_DIR / "events"), f".{uuid.uuid4().hex[:8]}")

    def _event(self, step: int, summary) -> None:
        from tensorboardX.proto.event_pb2 import Event

        self.writer.write_event(Event(wall_time=time.time(), step=step, summary=summary))

    def write(self, points: Points, tables: Tables) -> None:
        from tensorboardX import summary

        for tag, values in points.items():
            for step, value in values:
                self._event(step, summary.scalar(tag, value))
        for step, rows in tables.items():
            self._event(step, summary.text(SAMPLES_TAG, samples_markdown(rows)))
        self.writer.flush()

    def close(self, run: gateway_pb2.Run) -> None:
        self.writer.close()


class JsonlSink:
    name = "jsonl"

    def __init__(self, directory: Path) -> None:
        self.metrics = directory / METRICS_JSONL
        self.samples = directory / SAMPLES_JSONL

    def write(self, points: Points, tables: Tables) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for tag, values in points.items():
            for step, value in values:
                by_step.setdefault(step, {})[tag] = value
        if by_step:
            with self.metrics.open("a") as out:
                for step in sorted(by_step):
                    out.write(json.dumps({"step": step, "time": time.time(), **by_step[step]}) + "\n")
        if tables:
            with self.samples.open("a") as out:
                for rows in tables.values():
                    for row in rows:
                        out.write(json.dumps(_row(row)) + "\n")

    def close(self, run: gateway_pb2.Run) -> None:
        pass


def _row(row: gateway_pb2.SampleCompletion) -> dict[str, Any]:
    return {fd.name: getattr(row, fd.name) for fd in row.DESCRIPTOR.fields}


# MLflow keys: letters, digits, '_', '-', '.', ' ', ':' and '/'.
_MLFLOW_KEY = re.compile(r"[^\w\-. :/]")


def mlflow_key(tag: str) -> str:
    return _MLFLOW_KEY.sub("_", tag)


class MlflowSink:
    name = "mlflow"

    def __init__(self, directory: Path, cfg: LoggingSection, run: gateway_pb2.Run, state: dict) -> None:
        from mlflow import MlflowClient

        uri = cfg.mlflow_tracking_uri or (directory / MLFLOW_DIR).resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store for reading and writing only when asked to.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        name = cfg.mlflow_experiment or parse_recipe(run.recipe_toml, limits=RecipeLimits.ceilings()).run.name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = state.get("mlflow_run_id") or self._find(experiment_id, run.run_id)
        if not self.run_id:
            created = self.client.create_run(
                experiment_id, run_name=run.run_id, tags={MLFLOW_RUN_TAG: run.run_id}
            )
            self.run_id = created.info.run_id
            self._log_recipe(run)
        state["mlflow_run_id"] = self.run_id

    def _find(self, experiment_id: str, run_id: str) -> str:
        found = self.client.search_runs(
            [experiment_id], f"tags.`{MLFLOW_RUN_TAG}` = '{run_id}'", max_results=1
        )
        return found[0].info.run_id if found else ""

    def _log_recipe(self, run: gateway_pb2.Run) -> None:
        from mlflow.entities import Param

        recipe = parse_recipe(run.recipe_toml, limits=RecipeLimits.ceilings()).model_dump()
        params = [Param(mlflow_key(key), str(value)[:6000]) for key, value in _flatten(recipe).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_text(self.run_id, run.recipe_toml, "recipe.toml")

    def write(self, points: Points, tables: Tables) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(mlflow_key(tag), value, now, step)
            for tag, values in points.items()
            for step, value in values
        ]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        for step, rows in tables.items():
            table = {
                "columns": [fd.name for fd in gateway_pb2.SampleCompletion.DESCRIPTOR.fields],
                "data": [list(_row(row).values()) for row in rows],
            }
            self.client.log_dict(self.run_id, table, f"{SAMPLES_TAG}/step_{step:06d}.json")

    def close(self, run: gateway_pb2.Run) -> None:
        state = STATE_NAMES.get(run.state, "")
        status = {"completed": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}.get(state)
        if status:
            self.client.set_terminated(self.run_id, status)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(_flatten(inner, f"{prefix}{key}."))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, inner in enumerate(value):
            out.update(_flatten(inner, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: value}


class RunLogs:
    """The loggers of one run: `update` with each new view of the run writes only what each logger
    has not written yet (scalars by name and step, tables by step); `close` at its end."""

    def __init__(self, directory: Path, run: gateway_pb2.Run, cfg: LoggingSection | None = None) -> None:
        self.directory = directory
        self.cfg = cfg or logging_of(run)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / STATE_FILE
        self.state: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        self.sinks: list[Sink] = []
        for name in self.cfg.logger:
            try:
                sink = self._open(name, run)
            except MissingDependency as exc:
                print(f"looprl: {exc}; not logging to {name}", file=sys.stderr)
                continue
            except Exception as exc:  # a tracking server that does not answer must not stop the follower
                # Its progress stays as it was: a later follower writes exactly what it missed.
                print(
                    f"looprl: logging to {name} is off for this follower: it could not be opened ({exc!r}); "
                    f"`looprl watch {run.run_id}` writes what it missed once it can",
                    file=sys.stderr,
                )
                continue
            if sink is not None:
                self.sinks.append(sink)
        self._warned: set[str] = set()

    def _open(self, name: str, run: gateway_pb2.Run) -> Sink | None:
        sink_state = self.state.setdefault(name, {})
        if name == "tensorboard":
            return TensorBoardSink(self.directory)
        if name == "jsonl":
            return JsonlSink(self.directory)
        if name == "mlflow":
            check_available([name])
            return MlflowSink(self.directory, self.cfg, run, sink_state)
        return None  # console: the progress line the client prints

    def update(self, run: gateway_pb2.Run) -> None:
        every = scalars(run)
        tables: Tables = {}
        for row in run.samples:
            tables.setdefault(row.step, []).append(row)
        for sink in self.sinks:
            done = self.state.setdefault(sink.name, {})
            through: dict[str, int] = done.setdefault("through", {})
            points = {
                tag: new
                for tag, values in every.items()
                if (new := [(s, v) for s, v in values if s > through.get(tag, -1)])
            }
            new_tables = {
                s: rows for s, rows in sorted(tables.items()) if s > done.get("samples_through", -1)
            }
            if not points and not new_tables:
                continue
            try:
                sink.write(points, new_tables)
            except Exception as exc:  # a logger that fails must not stop following the run
                if sink.name not in self._warned:
                    self._warned.add(sink.name)
                    print(
                        f"looprl: logging to {sink.name} failed ({exc!r}); retrying with the next update",
                        file=sys.stderr,
                    )
                continue
            for tag, values in points.items():
                through[tag] = values[-1][0]
            if new_tables:
                done["samples_through"] = max(new_tables)
        self._save()

    def close(self, run: gateway_pb2.Run) -> None:
        self.update(run)
        for sink in self.sinks:
            try:
                sink.close(run)
            except Exception as exc:
                print(f"looprl: closing the {sink.name} log failed: {exc!r}", file=sys.stderr)

    def _save(self) -> None:
        path = self.directory / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        tmp.replace(path)


def describe(logs: RunLogs) -> str:
    """Where the run's logs are, for the client's last lines."""
    where = []
    for sink in logs.sinks:
        if isinstance(sink, TensorBoardSink):
            where.append(f"tensorboard --logdir {logs.directory / TENSORBOARD_DIR}")
        elif isinstance(sink, JsonlSink):
            where.append(str(sink.metrics))
        elif isinstance(sink, MlflowSink):
            where.append(f"MLflow run {sink.run_id} at {sink.uri}")
    return "; ".join(where)
