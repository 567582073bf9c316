"""The architecture, pinned: which packages may import which, and no import cycles.

An ast walk over every .py file in services/, gateway/, bench/, sim/, conformance/ and tests/ collects
every import, also the ones inside functions and `if TYPE_CHECKING:` blocks (a lazy import is still
a dependency and still closes a cycle). Rules:

- a service (gateway, or a package under services/ that is not shared) imports no other service;
- a shared package (services.kit, services.modeling, ..., the conformance kit) imports no service;
- nothing but a harness imports bench or sim (bench: benchmarks; sim: the simulator; tests import
  both), so no service depends on one;
- nothing but tests imports tests (tests/ is not installed: a bench that imported it would run only
  from a checkout);
- inside services.kit, a concern (a subpackage: bus, rpc, config, ...) imports only the concerns
  KIT_LAYERS allows it, and none imports a module at the kit's root (the entry point composes them);
- no two modules reach each other through imports (a cycle is reported module by module).
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("services", "gateway", "bench", "sim", "conformance", "tests")
# Packages under services/ that every service may use; every other package there is a service.
# A new shared package is added here, or its users fail. The conformance kit is a client of the
# contracts any service or tool may run, so it too imports no service.
SHARED = frozenset(
    {"services.kit", "services.modeling", "services.weights", "services.decisions", "conformance"}
)
# Harnesses, not parts of the product, and who may import each.
HARNESSES = {
    "bench": frozenset({"bench", "sim", "tests"}),
    "sim": frozenset({"bench", "sim", "tests"}),
    "tests": frozenset({"tests"}),
}
# services.kit's concerns and the concerns each may import (besides itself). A module at the kit's
# root (the entry point) may import any; a new concern is added here, or its imports fail.
KIT_LAYERS: dict[str, frozenset[str]] = {
    "bus": frozenset(),  # NATS JetStream: connection, consumers, streams, KV, subjects, NATS users
    "telemetry": frozenset(),  # tracing, logs, the metrics table
    "process": frozenset(),  # what a process knows of itself and its host
    "ray": frozenset(),  # joining Ray, surviving its head, autoscaled actor pools
    "usercode": frozenset(),  # plugins and code tests: user code, loaded and judged
    "local": frozenset({"process"}),  # the local stack's nats-server and Ray head processes
    "config": frozenset({"process"}),  # schema, recipes, service configs, the service table
    "messages": frozenset({"bus"}),  # formats services exchange: rollouts, reports, tensors
    "rpc": frozenset({"config", "telemetry", "process", "local"}),  # gRPC: server, TLS, authz
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (the most specific one that exists in the tree)
    where: str  # path:line of the import statement


def find_modules(root: Path, tops: tuple[str, ...] = SCANNED) -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is_package) for every .py under the given top-level folders."""
    modules: dict[str, tuple[Path, bool]] = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            modules[".".join(parts)] = (path, is_package)
    return modules


def _statements(node: ast.AST) -> Iterator[ast.stmt]:
    """Every statement, nested ones included (function and class bodies, if/try/with/loop blocks);
    imports are statements, so expressions need not be visited."""
    for name in ("body", "orelse", "finalbody", "handlers", "cases"):
        for child in getattr(node, name, ()):
            if isinstance(child, ast.stmt):
                yield child
            yield from _statements(child)


def _imported_names(module: str, path: Path, is_package: bool) -> Iterator[tuple[str, int]]:
    package = module if is_package else module.rpartition(".")[0]
    for node in _statements(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                parent = ".".join(base + ([node.module] if node.module else []))
            else:
                parent = node.module or ""
            # `from a.b import c` imports a.b.c when that is a module, else a name from a.b.
            for alias in node.names:
                yield f"{parent}.{alias.name}", node.lineno


def find_imports(root: Path, tops: tuple[str, ...] = SCANNED) -> list[Import]:
    """Every import between modules of the tree (imports of outside packages are left out)."""
    modules = find_modules(root, tops)
    found = []
    for module, (path, is_package) in modules.items():
        for name, line in _imported_names(module, path, is_package):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.append(Import(module, name, f"{path.relative_to(root)}:{line}"))
    return found


def owner(module: str) -> str:
    """The package a module belongs to for the layering rules: services.<name>, gateway, bench or
    tests."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "services" and len(parts) > 1 else parts[0]


def layering_violations(imports: list[Import], shared: frozenset[str] = SHARED) -> list[str]:
    problems = []
    for imp in imports:
        source, target = owner(imp.source), owner(imp.target)
        if source == target or target in shared or target == "services":
            continue
        if target in HARNESSES:
            if source not in HARNESSES[target]:
                allowed = ", ".join(sorted(HARNESSES[target]))
                problems.append(
                    f"{imp.where}: {imp.source} imports {imp.target} (only {allowed} import {target})"
                )
        elif source in shared or source == "services":
            problems.append(f"{imp.where}: shared {source} imports service {target} ({imp.target})")
        elif source not in HARNESSES:
            problems.append(f"{imp.where}: service {source} imports service {target} ({imp.target})")
    return sorted(problems)


def kit_concern(module: str, packages: set[str]) -> str | None:
    """The kit concern a module belongs to ("bus" for services.kit.bus.client), "" for a module at
    the kit's root, None outside the kit."""
    parts = module.split(".")
    if parts[:2] != ["services", "kit"]:
        return None
    if len(parts) > 2 and ".".join(parts[:3]) in packages:
        return parts[2]
    return ""


def kit_layer_violations(imports: list[Import], packages: set[str], layers=KIT_LAYERS) -> list[str]:
    problems = []
    for imp in imports:
        source, target = kit_concern(imp.source, packages), kit_concern(imp.target, packages)
        if not source or target is None or source == target:
            continue
        if source not in layers:
            problems.append(f"{imp.where}: services.kit.{source} is not in KIT_LAYERS")
        elif target == "":
            problems.append(f"{imp.where}: {imp.source} imports {imp.target}, at the kit's root")
        elif target not in layers[source]:
            allowed = ", ".join(sorted(layers[source])) or "no other concern"
            problems.append(
                f"{imp.where}: {imp.source} imports {imp.target} (kit {source} may import {allowed})"
            )
    return sorted(problems)


def kit_packages(root: Path) -> set[str]:
    return {name for name, (_, is_package) in find_modules(root, ("services",)).items() if is_package}


def import_cycles(imports: list[Import]) -> list[list[str]]:
    """One cycle (as the module path a -> b -> ... -> a) per strongly connected group of modules."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    # Tarjan's algorithm, iterative so a deep import chain cannot hit the recursion limit.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return [_cycle_in(group, graph) for group in groups]


def _cycle_in(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the group's first module (breadth-first inside the group)."""
    first = min(group)
    came_from: dict[str, str] = {}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), first]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {first} in {sorted(group)}")


def _describe(cycle: list[str], imports: list[Import]) -> str:
    steps = []
    for a, b in itertools.pairwise(cycle):
        where = next(i.where for i in imports if i.source == a and i.target == b)
        steps.append(f"{a} -> {b} ({where})")
    return "; ".join(steps)


# ---- the real tree ----------------------------------------------------------------------------


def test_the_walk_sees_every_package_and_the_lazy_imports():
    imports = find_imports(ROOT)
    sources = {owner(i.source) for i in imports}
    assert {
        "gateway",
        "bench",
        "tests",
        "services.kit",
        "services.trainer",
        "services.inference_router",
    } <= sources
    # A function-level import the walk must see (the trainer worker loads checkpoints lazily).
    assert any(
        i.source == "services.trainer.worker" and i.target == "services.trainer.checkpoint" for i in imports
    )


def test_no_service_imports_another_and_shared_packages_import_no_service():
    problems = layering_violations(find_imports(ROOT))
    assert not problems, "layering broken:\n" + "\n".join(problems)


def test_each_kit_concern_imports_only_the_concerns_below_it():
    problems = kit_layer_violations(find_imports(ROOT), kit_packages(ROOT))
    assert not problems, "kit layering broken:\n" + "\n".join(problems)


def test_no_import_cycles():
    imports = find_imports(ROOT)
    cycles = import_cycles(imports)
    assert not cycles, "import cycles:\n" + "\n".join(_describe(c, imports) for c in cycles)


# ---- the checker itself, on small trees -------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_function_level_cross_service_import_is_reported_with_its_line(tmp_path):
    root = _tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/kit/__init__.py": "",
            "services/kit/bus.py": "",
            "services/trainer/__init__.py": "",
            "services/trainer/loop.py": "from services.kit import bus\n\ndef f():\n    import services.reward.x\n",
            "services/reward/__init__.py": "",
            "services/reward/x.py": "",
        },
    )
    assert layering_violations(find_imports(root)) == [
        "services/trainer/loop.py:4: service services.trainer imports service services.reward "
        "(services.reward.x)"
    ]


def test_shared_packages_and_gateway_may_not_import_services_but_bench_may(tmp_path):
    root = _tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/kit/__init__.py": "",
            "services/kit/local.py": "try:\n    import os\nexcept ImportError:\n    from ..trainer import worker\n",
            "services/modeling/__init__.py": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from services.reward import verifiers\n",
            "services/trainer/__init__.py": "",
            "services/trainer/worker.py": "from bench import common\n",
            "services/reward/__init__.py": "",
            "services/reward/verifiers.py": "",
            "gateway/__init__.py": "",
            "gateway/app.py": "from services.trainer.worker import Worker\nfrom services.kit import local\n",
            "bench/__init__.py": "",
            "bench/common.py": "from services.trainer import worker\nfrom services.reward import verifiers\n",
        },
    )
    problems = layering_violations(find_imports(root))
    assert problems == [
        "gateway/app.py:1: service gateway imports service services.trainer (services.trainer.worker)",
        "services/kit/local.py:4: shared services.kit imports service services.trainer "
        "(services.trainer.worker)",
        "services/modeling/__init__.py:3: shared services.modeling imports service services.reward "
        "(services.reward.verifiers)",
        "services/trainer/worker.py:1: services.trainer.worker imports bench.common "
        "(only bench, sim, tests import bench)",
    ]
    # Declaring a package shared makes it importable by everyone (and holds it to the shared rule).
    assert not any(
        "services.reward" in p for p in layering_violations(find_imports(root), SHARED | {"services.reward"})
    )


def test_bench_may_not_import_tests_and_tests_may_import_bench(tmp_path):
    root = _tree(
        tmp_path,
        {
            "bench/__init__.py": "",
            "bench/harness/__init__.py": "",
            "bench/harness/hosts.py": "",
            "bench/packing.py": "from bench.harness import hosts\nfrom tests.support.rollouts import make\n",
            "tests/__init__.py": "",
            "tests/support/__init__.py": "",
            "tests/support/rollouts.py": "",
            "tests/unit/test_packing.py": "from bench.harness.hosts import x\nfrom tests.support import rollouts\n",
            "services/__init__.py": "",
            "services/kit/__init__.py": "",
            "services/kit/bus.py": "def f():\n    from tests.support import rollouts\n",
        },
    )
    assert layering_violations(find_imports(root)) == [
        "bench/packing.py:2: bench.packing imports tests.support.rollouts (only tests import tests)",
        "services/kit/bus.py:2: services.kit.bus imports tests.support.rollouts (only tests import tests)",
    ]


def test_a_cycle_through_a_lazy_import_is_reported_module_by_module(tmp_path):
    root = _tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/env/__init__.py": "",
            "services/env/loop.py": "from services.env.clients import Client\n",
            "services/env/clients.py": "def f():\n    from .types import T\n",
            "services/env/types.py": "def g():\n    from services.env import loop\n",
            "services/env/other.py": "from services.env import types\n",
        },
    )
    imports = find_imports(root)
    assert import_cycles(imports) == [
        ["services.env.clients", "services.env.types", "services.env.loop", "services.env.clients"]
    ]
    assert _describe(import_cycles(imports)[0], imports) == (
        "services.env.clients -> services.env.types (services/env/clients.py:2); "
        "services.env.types -> services.env.loop (services/env/types.py:2); "
        "services.env.loop -> services.env.clients (services/env/loop.py:1)"
    )
    # Without the lazy import in types.py the same modules form no cycle.
    assert import_cycles([i for i in imports if i.source != "services.env.types"]) == []


def test_a_kit_concern_importing_one_above_it_or_the_kit_root_is_reported(tmp_path):
    root = _tree(
        tmp_path,
        {
            "services/__init__.py": "",
            "services/kit/__init__.py": "",
            "services/kit/entrypoint.py": "from services.kit.rpc import server\nfrom services.kit.bus import client\n",
            "services/kit/bus/__init__.py": "",
            "services/kit/bus/client.py": "from services.kit.bus import errors\n",
            "services/kit/bus/errors.py": "def f():\n    from services.kit.rpc.server import serve\n",
            "services/kit/rpc/__init__.py": "",
            "services/kit/rpc/server.py": "from services.kit.bus import client\nfrom services.kit import entrypoint\n",
            "services/kit/extra/__init__.py": "from services.kit.bus import client\n",
        },
    )
    problems = kit_layer_violations(find_imports(root), kit_packages(root))
    assert problems == [
        "services/kit/bus/errors.py:2: services.kit.bus.errors imports services.kit.rpc.server "
        "(kit bus may import no other concern)",
        "services/kit/extra/__init__.py:1: services.kit.extra is not in KIT_LAYERS",
        "services/kit/rpc/server.py:1: services.kit.rpc.server imports services.kit.bus.client "
        "(kit rpc may import config, local, process, telemetry)",
        "services/kit/rpc/server.py:2: services.kit.rpc.server imports services.kit.entrypoint, at the kit's root",
    ]
