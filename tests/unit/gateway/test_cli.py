"""The CLI's rough edges: `looprl restart` with a name the stack does not run, or with no stack, is a
clear message, not a traceback; the common options go before or after the subcommand; `looprl stop`
returns within its deadline."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from gateway import cli
from gateway.stack import ServiceProcess, StackState
from services.kit.config import registry
from tests.support.stack import free_port_args


def _saved_stack(state_dir: Path) -> StackState:
    # pid 0 is never a service's: the command must refuse before it signals anything.
    services = [
        ServiceProcess(s.name, 0, 1, 2, str(state_dir / f"{s.name}.log"), s.package)
        for s in registry.SERVICES
    ]
    state = StackState(str(state_dir), 1, 0, 2, 0, "ray-token", "gateway-token", 3, services)
    state.save()
    return state


def test_restart_of_an_unknown_service_lists_the_services_and_fails(tmp_path: Path, capsys) -> None:
    _saved_stack(tmp_path)
    assert cli.main(["--state-dir", str(tmp_path), "restart", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unknown service 'nope'; the stack runs: weight-sync, inference-router, ")
    assert all(name in err for name in registry.NAMES)


def test_restart_without_a_stack_says_so(tmp_path: Path, capsys) -> None:
    assert cli.main(["--state-dir", str(tmp_path), "restart", "gateway"]) == 1
    assert "no local stack is up" in capsys.readouterr().err


def test_the_common_options_work_after_the_subcommand_too(tmp_path: Path, capsys) -> None:
    _saved_stack(tmp_path)
    assert cli.main(["restart", "nope", "--state-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("unknown service 'nope'; the stack runs: weight-sync")
    # Given on both sides, the one after the subcommand wins (the first names no stack: exit 1).
    assert (
        cli.main(["--state-dir", str(tmp_path / "none"), "restart", "nope", "--state-dir", str(tmp_path)])
        == 2
    )
    assert cli.main(["--state-dir", str(tmp_path / "none"), "restart", "nope"]) == 1


def test_stop_returns_within_its_deadline_when_the_gateway_does_not_answer(capsys) -> None:
    # A gateway that accepts connections and never answers (hung): the stop must not hang with it.
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen()
        address = f"127.0.0.1:{hung.getsockname()[1]}"
        started = time.monotonic()
        code = cli.main(["stop", "run-1", "--gateway", address, "--token", "t", "--timeout", "1.5"])
        took = time.monotonic() - started
    assert code == 1 and took < 10
    assert "did not confirm within 1.5s that run run-1 stopped; `looprl runs` shows its state" in (
        capsys.readouterr().err
    )


def test_run_help_lists_every_recipe_field_with_its_type_default_and_doc(capsys) -> None:
    from services.kit.config.recipe import Recipe
    from services.kit.config.schema import field_rows

    with pytest.raises(SystemExit) as done:
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "  run.steps: int = 20  (>= 1, <= the cluster's max_steps)\n      Number of trainer steps" in out
    assert all(f"  {row.path}: {row.type} = " in out for row in field_rows(Recipe))
    # Other commands' help does not load the schema.
    with pytest.raises(SystemExit):
        cli.main(["up", "--help"])
    assert "recipe fields" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("option", "label"), [("--http-port", "gateway HTTP"), ("--nats-port", "nats-server")]
)
def test_up_on_a_taken_port_names_it_and_its_option_and_starts_nothing(
    tmp_path: Path, capsys, option: str, label: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(["up", "--state-dir", str(tmp_path), *free_port_args(), option, str(port)])
    assert code == 2
    assert capsys.readouterr().err == (
        f"looprl: {label}: port {port} is already in use; choose another with its port setting ({option})\n"
    )
    assert StackState.load(tmp_path) is None and not (tmp_path / "nats-server.log").exists()


def test_up_where_a_stack_is_already_up_says_so(tmp_path: Path, capsys) -> None:
    state = _saved_stack(tmp_path)
    state.nats_pid = os.getpid()  # a live process: the stack counts as up
    state.save()
    assert cli.main(["up", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("looprl: a stack is already up") and "run `looprl down` first" in err


def test_plugin_and_data_directories_reach_the_services_as_one_setting_each(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    env = cli._plugin_env([str(tmp_path / "a"), str(tmp_path / "b")])
    assert env == {"LOOPRL_PLUGIN_DIRS": f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}"}
    with pytest.raises(SystemExit, match=r"--plugin-dir .*missing' is not a directory"):
        cli._plugin_env([str(tmp_path / "missing")])
    both = cli._plugin_env([str(tmp_path / "a")], [str(tmp_path / "b")])
    assert both == {"LOOPRL_PLUGIN_DIRS": str(tmp_path / "a"), "LOOPRL_DATA_DIRS": str(tmp_path / "b")}
    with pytest.raises(SystemExit, match=r"--data-dir .*missing' is not a directory"):
        cli._plugin_env([], [str(tmp_path / "missing")])


def test_eval_without_the_steps_export_says_where_it_looked(tmp_path: Path, monkeypatch, capsys) -> None:
    from looprl.gateway.v1 import gateway_pb2

    class Gateway:
        def GetRun(self, request, metadata=None):
            return gateway_pb2.GetRunResponse(
                run=gateway_pb2.Run(run_id=request.run_id, recipe_toml="", weight_version=7)
            )

    monkeypatch.setattr(cli, "_gateway", lambda args: (Gateway(), ()))
    assert cli.main(["--state-dir", str(tmp_path), "eval", "r1", "--wait", "0"]) == 2
    err = capsys.readouterr().err
    assert f"no Hugging Face export of run r1 at step 7 in {tmp_path / 'trainer/r1/hf/step_00000007'}" in err
    # A step the run trained past is not waited for: its export was written then, or pruned since.
    for step in (4, 6):
        (tmp_path / f"trainer/r1/hf/step_{step:08d}").mkdir(parents=True)
    started = time.monotonic()
    assert cli.main(["--state-dir", str(tmp_path), "eval", "r1", "--step", "2", "--wait", "60"]) == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert "at step 2 in" in err and "keep_eval_exports" in err and "exported there: 4, 6;" in err


def test_eval_of_a_lora_run_evaluates_its_merged_export(tmp_path: Path, monkeypatch, capsys) -> None:
    """A LoRA run's export of a step is its adapter (PEFT), with the merged model in merged/ when
    model.lora.merge_on_export: the evaluation run loads that, a plain model."""
    from looprl.gateway.v1 import gateway_pb2
    from services.kit.config.recipe import parse_recipe
    from services.modeling.config import ModelConfig
    from services.modeling.qwen2 import Qwen2ForCausalLM

    base = tmp_path / "base"
    Qwen2ForCausalLM(ModelConfig.tiny(), seed=0).save_pretrained(base)
    recipe = (
        f'[model]\npath = "{base}"\n[model.lora]\nrank = 4\n'
        '[[deployments]]\nname = "lora"\nshared = true\nmax_loras = 4\n'
    )
    export = tmp_path / "trainer/r1/hf/step_00000005"
    export.mkdir(parents=True)
    (export / "adapter_config.json").write_text("{}")
    submitted = []

    class Gateway:
        def GetRun(self, request, metadata=None):
            return gateway_pb2.GetRunResponse(
                run=gateway_pb2.Run(run_id="r1", recipe_toml=recipe, weight_version=5)
            )

        def CreateRun(self, request, metadata=None):
            submitted.append(request.recipe_toml)
            raise SystemExit(0)  # far enough: what was submitted

    monkeypatch.setattr(cli, "_gateway", lambda args: (Gateway(), ()))
    argv = ["--state-dir", str(tmp_path), "eval", "r1", "--wait", "0"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "run r1 trains a LoRA adapter: its export of step 5" in err and "merge_on_export" in err
    Qwen2ForCausalLM(ModelConfig.tiny(), seed=0).save_pretrained(export / "merged")
    with pytest.raises(SystemExit):
        cli.main(argv)
    evaluated = parse_recipe(submitted[0])
    assert evaluated.model.lora is None and evaluated.model.path == str((export / "merged").resolve())
    assert (evaluated.deployments[0].shared, evaluated.deployments[0].max_loras) == (False, 0)
    assert evaluated.eval.checkpoint_step == 5
    # Step 0 is the run's initial model, which needs no export: its base, the adapter starting as
    # the identity.
    with pytest.raises(SystemExit):
        cli.main([*argv, "--step", "0"])
    initial = parse_recipe(submitted[1])
    assert initial.model.lora is None and initial.model.path == str(base)
    assert (initial.deployments[0].shared, initial.eval.checkpoint_step) == (False, 0)
