"""The service registry (services/kit/config/registry.py) and the one entry point built on it
(services/kit/entrypoint.py): every entry resolves, every package is laid out the same way, and
`--help` lists the settings without importing anything heavy."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.kit.config import registry
from services.kit.config.service import ServiceConfig
from services.kit.entrypoint import run_service, settings_help

ROOT = Path(__file__).resolve().parents[4]
HEAVY = ("torch", "ray", "grpc", "vllm", "transformers")
SPECS = {spec.name: spec for spec in registry.SERVICES}


def package_dir(spec: registry.ServiceSpec) -> Path:
    return ROOT / spec.package.replace(".", "/")


def test_names_are_unique_and_lookup_names_the_known_ones():
    assert len(SPECS) == len(registry.SERVICES)
    assert registry.service("reward") is SPECS["reward"]
    with pytest.raises(KeyError, match="inference-router"):
        registry.service("rewards")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_entry_resolves_to_a_config_class_and_an_async_serve(name):
    spec = SPECS[name]
    cls = spec.config_class()
    assert issubclass(cls, ServiceConfig)
    fields = set(cls.model_fields)
    assert spec.env_prefix.isupper() and spec.env_prefix.isidentifier()
    for peer in spec.peers:
        assert peer in SPECS and peer != name
        address = SPECS[peer].address_field
        assert address in fields, f"{name} calls {peer} but its config has no {address}"
    assert importlib.util.find_spec(spec.serve.partition(":")[0]) is not None


def test_every_address_field_names_a_service_someone_calls():
    called = {peer for spec in registry.SERVICES for peer in spec.peers}
    assert {s.name for s in registry.SERVICES if s.address_field} == called


def test_peers_are_callers_the_authorization_table_allows():
    from services.kit.rpc.authz import POLICY

    for spec in registry.SERVICES:
        for peer in spec.peers:
            callers = set().union(*POLICY[SPECS[peer].grpc_service].values())
            assert spec.name in callers, f"{spec.name} calls {peer}, which admits only {sorted(callers)}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_package_has_the_service_skeleton(name):
    spec = SPECS[name]
    folder = package_dir(spec)
    for module in ("__main__.py", "config.py", "service.py", "servicer.py"):
        assert (folder / module).is_file(), f"{spec.package} has no {module}"
    main = (folder / "__main__.py").read_text()
    assert f'run_service("{name}")' in main and len(main.splitlines()) < 12, "__main__ is one call"
    assert spec.serve == f"{spec.package}.service:serve"


def test_help_lists_every_setting_with_type_default_and_variable(capsys):
    assert run_service("reward", ["--help"]) == 0
    out = capsys.readouterr().out
    cls = SPECS["reward"].config_class()
    for name in cls.model_fields:
        assert f"  LOOPRL_REWARD_{name.upper()}" in out
    assert (
        "  LOOPRL_REWARD_CODE_TIMEOUT_S: float = 5.0  (> 0.0)\n      Wall-clock limit for one code-tests run."
        in out
    )
    assert settings_help(SPECS["reward"]) in out


def test_an_unknown_argument_is_refused(capsys):
    assert run_service("trainer", ["--bogus"]) == 2
    assert "--help" in capsys.readouterr().err


def test_a_bad_setting_is_a_configuration_error_before_serving(monkeypatch, capsys):
    monkeypatch.setenv("LOOPRL_INFERENCE_ROUTER_DEPLOYMENTS", '[{"nme": "x"}]')
    assert run_service("inference-router", []) == 2
    err = capsys.readouterr().err
    assert (
        "inference-router: configuration error: LOOPRL_INFERENCE_ROUTER_DEPLOYMENTS[0].nme: unknown field"
        in err
    )


def test_help_imports_nothing_heavy():
    """In a fresh interpreter (this one has imported everything): --help of every service."""
    probe = (
        "import contextlib, io, json, sys\n"
        "from services.kit.entrypoint import run_service\n"
        "from services.kit.config.registry import NAMES\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    codes = [run_service(name, ['--help']) for name in NAMES]\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(json.dumps({'codes': codes, 'heavy': heavy}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result == {"codes": [0] * len(registry.NAMES), "heavy": []}
