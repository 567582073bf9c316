"""Regroup the tree (issue 45): services/kit/ by concern, tests/unit/ mirroring the source, and the
integration tests grouped per service.

    python tools/regroup.py            # move and rewrite, then ruff --fix and ruff format
    python tools/regroup.py --dry-run  # print the moves only

Deterministic and re-runnable on any later main: the moves come from the tables below (a module a
table does not know is placed by what it imports, and said so), every file is moved with `git mv`,
and every reference to a moved module or file is rewritten across the repository (imports, dotted
names in strings such as mock targets and `python -m`, paths in docs, configs, the Makefile and
deploy files). A second run finds nothing to move and changes nothing. No module is left at an old
path: nothing re-exports the old names.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIT = "services/kit"

# services/kit/<old>.py -> services/kit/<concern>/<new>.py. entrypoint.py stays at the kit's root:
# it composes the concerns. The concerns' allowed imports: tests/unit/test_architecture.py KIT_LAYERS.
KIT_MODULES: dict[str, str] = {
    "bus": "bus/client",
    "bus_consumer": "bus/consumer",
    "bus_streams": "bus/streams",
    "bus_errors": "bus/errors",
    "kv": "bus/kv",
    "subjects": "bus/subjects",
    "nats_auth": "bus/nats_auth",
    "rollout_messages": "messages/rollouts",
    "run_errors": "messages/run_errors",
    "trainer_epochs": "messages/trainer_epochs",
    "packer_reports": "messages/packer_reports",
    "micro_batch": "messages/micro_batch",
    "codec": "messages/codec",
    "array_codec": "messages/array_codec",
    "server": "rpc/server",
    "interceptors": "rpc/interceptors",
    "errors": "rpc/errors",
    "authz": "rpc/authz",
    "tls": "rpc/tls",
    "raw_requests": "rpc/raw_requests",
    "config": "config/service",
    "schema": "config/schema",
    "recipe": "config/recipe",
    "limits": "config/limits",
    "registry": "config/registry",
    "telemetry": "telemetry/tracing",
    "logs": "telemetry/logs",
    "metric_names": "telemetry/metrics",
    "ray_utils": "ray/cluster",
    "ray_head": "ray/head_loss",
    "ray_start": "ray/start",
    "autoscale": "ray/autoscale",
    "autoscaled_pool": "ray/autoscaled_pool",
    "local": "local/infra",
    "listeners": "process/listeners",
    "hosts": "process/hosts",
    "gc_freeze": "process/gc_freeze",
    "plugins": "usercode/plugins",
    "code_tests": "usercode/code_tests",
}

KIT_CONCERNS: dict[str, str] = {
    "bus": "The event bus: a NATS JetStream connection and publishing (client), pull consumers and their\n"
    "deliveries (consumer), stream and bucket provisioning (streams), KV buckets (kv), the names on\n"
    "the bus (subjects), per-service NATS users (nats_auth) and the bus's errors.",
    "messages": "What services exchange, written once for both sides: rollouts on the ROLLOUTS stream, a\n"
    "run's errors, the trainer's epochs, the packer's reports, micro-batch tensor names and the\n"
    "tensor codecs.",
    "rpc": "gRPC: the server bootstrap, interceptors, status errors, the authorization table, mutual\n"
    "TLS identities and raw-bytes request handlers.",
    "config": "Configuration: the schema's building blocks, run recipes, service configs from the\n"
    "environment, the cluster limits and the table of services.",
    "telemetry": "Telemetry: tracing (OpenTelemetry), structured logs and the table of every metric.",
    "ray": "Ray: joining the configured cluster, surviving the loss of its head, `ray start` for the\n"
    "local stack, and autoscaled actor pools.",
    "local": "The local stack's infrastructure processes: an embedded nats-server and a Ray head.",
    "process": "A process and its host: which ports processes listen on, host identity for shared\n"
    "memory, and a ready process's startup objects kept out of the garbage collector's way.",
    "usercode": "User code: plugins named by a recipe, and code tests whose verdict the tested code\n"
    "cannot forge.",
}

# tests/unit/kit/<file> -> the concern it tests (a file not listed goes where most of its kit
# imports are).
KIT_TESTS: dict[str, str] = {
    "test_autoscaled_pool.py": "ray",
    "test_kit_autoscale.py": "ray",
    "test_ray_head.py": "ray",
    "test_ray_start.py": "ray",
    "test_gc_freeze.py": "process",
    "test_hosts.py": "process",
    "test_listeners.py": "process",
    "test_local_ports.py": "local",
    "test_local_ray_logs.py": "local",
    "test_wait_for_port.py": "local",
    "test_kit_config_recipe_codec.py": "config",
    "test_recipe_bounds.py": "config",
    "test_recipe_task_sections.py": "config",
    "test_registry.py": "config",
    "test_metric_names.py": "telemetry",
    "test_telemetry_links.py": "telemetry",
    "test_nats_auth.py": "bus",
    "test_subjects.py": "bus",
    "test_rollout_messages.py": "messages",
    "test_trainer_epochs.py": "messages",
    "test_kit_plugins.py": "usercode",
}

# tests/integration/<file> -> the folder of the service (or shared package) it exercises, by file
# name prefix; a file no prefix matches goes by its imports.
INTEGRATION_PREFIXES: tuple[tuple[str, str], ...] = (
    ("test_router_", "inference_router"),
    ("test_engine_", "inference_router"),
    ("test_replica_", "inference_router"),
    ("test_lora", "trainer"),
    ("test_packer_", "rollout_packer"),
    ("test_weightsync_", "weight_sync"),
    ("test_weight_sync_", "weight_sync"),
    ("test_trainer_", "trainer"),
    ("test_bring_your_own_model", "trainer"),
    ("trainer_steps", "trainer"),
    ("test_env_", "environment_sandbox"),
    ("test_sandbox_", "environment_sandbox"),
    ("test_run_tokenizer", "environment_sandbox"),
    ("test_reward_", "reward"),
    ("test_gateway_", "gateway"),
    ("test_kit_", "kit"),
    ("test_bus", "kit"),
    ("test_local_infra", "kit"),
    ("test_ray_head_loss", "kit"),
    ("test_netns_hosts", "bench"),
    ("test_conformance_kit", "conformance"),
)

# Text files that keep their text: generated code, lock files, recorded results, this script, and
# the architecture test (its small trees are examples, not the repository's layout).
SKIP_REWRITE = (
    re.compile(r"^protos/looprl/.*_pb2"),
    re.compile(r"\.(lock|png|jpg|jsonl|ico|gz|whl)$"),
    re.compile(r"^(tools/regroup|tests/unit/tools/test_regroup)\.py$"),
    re.compile(r"^tests/unit/test_architecture\.py$"),
    re.compile(r"(^|/)package-lock\.json$"),
)

SOURCE_TOPS = ("services", "gateway", "bench", "sim", "conformance")


@dataclass(frozen=True)
class Move:
    old: str  # repository-relative paths
    new: str
    why: str


def module_of(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def tracked() -> list[str]:
    return [p for p in git("ls-files", "-z").split("\0") if p and (ROOT / p).is_file()]


# ---- planning -----------------------------------------------------------------------------------


def kit_moves() -> list[Move]:
    moves = []
    for old, new in KIT_MODULES.items():
        if (ROOT / KIT / f"{old}.py").exists():
            moves.append(Move(f"{KIT}/{old}.py", f"{KIT}/{new}.py", "kit concern"))
    return moves


def imported_modules(path: Path) -> list[str]:
    """Every module (or module.name) the file imports, absolute imports only."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [f"{node.module}.{a.name}" for a in node.names]
    return found


def source_packages() -> set[str]:
    """Dotted names of the source packages (folders with __init__.py) under SOURCE_TOPS."""
    packages = set()
    for top in SOURCE_TOPS:
        for init in (ROOT / top).rglob("__init__.py"):
            packages.add(module_of(str(init.relative_to(ROOT))))
    return packages


def package_of(name: str, packages: set[str], renamed: dict[str, str]) -> str | None:
    """The deepest source package holding an imported name, in the regrouped layout."""
    for old, new in renamed.items():
        if name == old or name.startswith(old + "."):
            name = new + name[len(old) :]
            break
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in packages:
            return ".".join(parts[:n])
    return None


def test_dir_for(package: str) -> str:
    """tests/unit/<the package's path without services/>: services.inference_router.engine ->
    inference_router/engine; gateway -> gateway."""
    parts = package.split(".")
    if parts[0] == "services":
        parts = parts[1:]
    return "/".join(parts)


def has_sibling_imports(path: Path) -> bool:
    """Whether the file imports a module that sits beside it by bare name (sys.path-relative): it
    must stay beside it."""
    siblings = {p.stem for p in path.parent.glob("*.py")}
    return any(name.split(".")[0] in siblings for name in imported_modules(path))


def unit_test_moves(kit_renamed: dict[str, str], kit_concerns: set[str]) -> list[Move]:
    """tests/unit/<top>/test_*.py into the folder of the package they test: a kit test into its
    concern; another into the subpackage of its own package that all its imports of that package
    come from, or into another package when that is the only source package it imports (the kit
    aside)."""
    packages = source_packages() | {f"services.kit.{c}" for c in kit_concerns}
    tops = {test_dir_for(p).split("/")[0] for p in packages}
    moves = []
    for path in sorted((ROOT / "tests" / "unit").glob("*/test_*.py")):
        rel = str(path.relative_to(ROOT))
        top = path.parent.name
        if has_sibling_imports(path):
            continue
        owned = {
            test_dir_for(p)
            for name in imported_modules(path)
            if (p := package_of(name, packages, kit_renamed)) is not None
        }
        if top == "kit":
            concern = KIT_TESTS.get(path.name)
            why = "kit table"
            if concern is None:
                counts = Counter(
                    test_dir_for(p).split("/")[1]
                    for name in imported_modules(path)
                    if (p := package_of(name, packages, kit_renamed) or "").startswith("services.kit.")
                )
                if not counts:
                    print(f"  left: {rel} (imports no kit concern)")
                    continue
                concern = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
                why = f"imports kit {concern} most"
            target = f"tests/unit/kit/{concern}/{path.name}"
        else:
            mine = {d for d in owned if d == top or d.startswith(top + "/")}
            others = {d for d in owned - mine if d.split("/")[0] != "kit"}
            if len(mine) == 1 and mine != {top}:
                (sub,) = mine
                target, why = f"tests/unit/{sub}/{path.name}", "imports only that subpackage of its package"
            elif not mine and top in tops and len(others) == 1:
                (only,) = others
                target, why = f"tests/unit/{only}/{path.name}", "imports only that package"
            else:
                continue
        if target != rel:
            moves.append(Move(rel, target, why))
    return moves


def integration_moves(kit_renamed: dict[str, str]) -> list[Move]:
    packages = source_packages()
    moves = []
    folder = ROOT / "tests" / "integration"
    for path in sorted(folder.glob("*.py")):
        if path.name == "conftest.py":
            continue
        rel = str(path.relative_to(ROOT))
        service = next((s for prefix, s in INTEGRATION_PREFIXES if path.name.startswith(prefix)), None)
        why = "name"
        if service is None:
            counts = Counter(
                test_dir_for(p).split("/")[0]
                for name in imported_modules(path)
                if (p := package_of(name, packages, kit_renamed)) is not None
                and not p.startswith(("services.kit", "services.modeling", "services.weights", "bench"))
            )
            if not counts:
                print(f"  left: {rel} (no service imported; add it to INTEGRATION_PREFIXES)")
                continue
            service = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0][0]
            why = f"imports {service} most"
        moves.append(Move(rel, f"tests/integration/{service}/{path.name}", why))
    return moves


def plan() -> list[Move]:
    kit = kit_moves()
    renamed = {module_of(m.old): module_of(m.new) for m in kit}
    concerns = {m.new.split("/")[2] for m in kit} | {
        p.name for p in (ROOT / KIT).iterdir() if (p / "__init__.py").exists()
    }
    return kit + unit_test_moves(renamed, concerns) + integration_moves(renamed)


def check(moves: list[Move]) -> None:
    targets = [m.new for m in moves]
    if len(set(targets)) != len(targets):
        raise SystemExit(f"two files move to one path: {[t for t, n in Counter(targets).items() if n > 1]}")
    for m in moves:
        if (ROOT / m.new).exists():
            raise SystemExit(f"{m.new} exists already (moving {m.old})")
    # pytest (rootdir import mode, no __init__.py under tests/) needs test file names unique.
    names = Counter(
        Path(p).name for p in tracked() if p.startswith("tests/") and Path(p).name.startswith("test_")
    )
    clashes = [n for n, c in names.items() if c > 1]
    if clashes:
        raise SystemExit(f"test file names used twice: {clashes}")
    # A helper imported by bare name must end up beside every file that imports it.
    new_dir = {m.old: str(Path(m.new).parent) for m in moves}
    for m in moves:
        if Path(m.old).name.startswith("test_"):
            continue
        stem, here = Path(m.old).stem, str(Path(m.old).parent)
        users = [
            p
            for p in tracked()
            if p.endswith(".py")
            and p != m.old
            and str(Path(p).parent) == here
            and any(n.split(".")[0] == stem for n in imported_modules(ROOT / p))
        ]
        for p in users:
            if new_dir.get(p, here) != str(Path(m.new).parent):
                raise SystemExit(f"{p} imports {stem} by bare name but would not sit beside it")


# ---- moving and rewriting -----------------------------------------------------------------------


def move(moves: list[Move]) -> list[str]:
    """git mv every file; the kit's new concerns get an __init__.py saying what they hold."""
    for m in moves:
        (ROOT / m.new).parent.mkdir(parents=True, exist_ok=True)
        git("mv", m.old, m.new)
    made = []
    for concern, doc in KIT_CONCERNS.items():
        init = ROOT / KIT / concern / "__init__.py"
        if (ROOT / KIT / concern).is_dir() and not init.exists():
            init.write_text(f'"""{doc}\n"""\n' if "\n" in doc else f'"""{doc}"""\n')
            made.append(str(init.relative_to(ROOT)))
    return made


def _alternation(names: list[str]) -> str:
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


def rewrite_text(text: str, modules: dict[str, str], paths: dict[str, str]) -> str:
    if modules:
        dotted = re.compile(rf"(?<![\w.])({_alternation(list(modules))})(?!\w)")
        text = dotted.sub(lambda m: modules[m.group(1)], text)
    if paths:
        full = re.compile(rf"(?<![\w.-])({_alternation(list(paths))})(?![\w/])")
        text = full.sub(lambda m: paths[m.group(1)], text)
        # The kit's modules named from inside services/ ("kit/bus.py").
        short = {
            k[len("services/") :]: v[len("services/") :] for k, v in paths.items() if k.startswith(f"{KIT}/")
        }
        if short:
            part = re.compile(rf"(?<![\w/.-])({_alternation(list(short))})(?![\w/])")
            text = part.sub(lambda m: short[m.group(1)], text)
    return text


def rewrite_from_imports(text: str, modules: dict[str, str]) -> str:
    """`from services.kit import tls, bus` -> `from services.kit.rpc import tls` and
    `from services.kit.bus import client as bus`: an import of a moved module by its parent."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.split("\n")
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
            continue
        if not any(f"{node.module}.{a.name}" in modules for a in node.names):
            continue
        indent = " " * node.col_offset
        kept = [a for a in node.names if f"{node.module}.{a.name}" not in modules]
        out = []
        if kept:
            out.append(
                f"{indent}from {node.module} import " + ", ".join(_alias(a.name, a.asname) for a in kept)
            )
        for a in node.names:
            new = modules.get(f"{node.module}.{a.name}")
            if new is not None:
                parent, _, name = new.rpartition(".")
                out.append(f"{indent}from {parent} import {_alias(name, a.asname or a.name)}")
        edits.append((node.lineno - 1, node.end_lineno or node.lineno, out))
    for start, end, out in sorted(edits, reverse=True):
        comment = re.search(r"\s+#.*$", lines[end - 1])  # a comment after the statement stays
        lines[start:end] = out
        if comment:
            lines[start] += comment.group(0)
    return "\n".join(lines)


def rewrite_quoted_imports(text: str, modules: dict[str, str]) -> str:
    """The same for an import written inside a string (code a test runs in a subprocess), one
    line, one name."""

    def one(m: re.Match[str]) -> str:
        new = modules.get(f"{m['parent']}.{m['name']}")
        if new is None:
            return m.group(0)
        parent, _, name = new.rpartition(".")
        return f"from {parent} import {_alias(name, m['asname'] or m['name'])}"

    pattern = r"from (?P<parent>[\w.]+) import (?P<name>\w+)(?: as (?P<asname>\w+))?(?![\w,])"
    return re.sub(pattern, one, text)


def _alias(name: str, asname: str | None) -> str:
    return name if not asname or asname == name else f"{name} as {asname}"


_PARENTS = re.compile(r"(Path\(__file__\)(?:\.resolve\(\))?)((?:\.parent)+)(?![\w\[])")
_PARENTS_N = re.compile(r"(Path\(__file__\)(?:\.resolve\(\))?\.parents\[)(\d+)(\])")


def reanchor(text: str, delta: int) -> str:
    """A moved file's `Path(__file__)` climbs `delta` more folders to reach the same place."""
    if not delta:
        return text
    text = _PARENTS_N.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + delta}{m.group(3)}", text)
    return _PARENTS.sub(lambda m: f"{m.group(1)}.parents[{m.group(2).count('.parent') - 1 + delta}]", text)


def kit_docstring() -> str:
    lines = [
        '"""The service kit: what every looprl service needs, written once, one subpackage per concern.',
        "",
    ]
    for concern, doc in KIT_CONCERNS.items():
        lines += textwrap.wrap(f"- {concern}: {' '.join(doc.split())}", 100, subsequent_indent="  ")
    lines += [
        "",
        "entrypoint (the thin `python -m <service>` entry point) composes them. Which concern may import",
        "which: KIT_LAYERS in tests/unit/test_architecture.py.",
        '"""',
        "",
    ]
    return "\n".join(lines)


def apply(moves: list[Move]) -> list[str]:
    modules = {module_of(m.old): module_of(m.new) for m in moves}
    paths = {m.old: m.new for m in moves}
    # As a regular expression writes them (a test matching an error message that names the file).
    paths |= {m.old.replace(".py", "\\.py"): m.new.replace(".py", "\\.py") for m in moves}
    # A kit module named as a path without its suffix ("see services/kit/code_tests").
    paths |= {m.old[:-3]: m.new[:-3] for m in moves if m.old.startswith(f"{KIT}/")}
    changed = move(moves)
    for rel in tracked():
        if any(p.search(rel) for p in SKIP_REWRITE):
            continue
        path = ROOT / rel
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite_text(text, modules, paths)
        if rel.endswith(".py"):
            new = rewrite_from_imports(new, modules)
        new = rewrite_quoted_imports(new, modules)
        old_rel = next((m.old for m in moves if m.new == rel), None)
        if old_rel is not None and rel.endswith(".py"):
            new = reanchor(new, len(Path(rel).parts) - len(Path(old_rel).parts))
        if new != text:
            path.write_text(new)
            changed.append(rel)
    if any(m.old.startswith(f"{KIT}/") for m in moves):
        (ROOT / KIT / "__init__.py").write_text(kit_docstring())
        changed.append(f"{KIT}/__init__.py")
    return changed


# Generated from text the rewrite may touch (proto comments, config docstrings, docs).
GENERATORS = ("gen_protos.py", "gen_config_docs.py", "gen_conformance_docs.py", "gen_bench_table.py")


def tidy(changed: list[str]) -> None:
    """Imports sorted and formatted (ruff), generated code and docs rendered again, all staged."""
    python = [p for p in changed if p.endswith(".py") and (ROOT / p).exists()]
    ruff = [sys.executable, "-m", "ruff"]
    if python:
        subprocess.run([*ruff, "check", "--fix", "--quiet", *python], cwd=ROOT, check=False)
        subprocess.run([*ruff, "format", "--quiet", *python], cwd=ROOT, check=True)
    for tool in GENERATORS:
        if (ROOT / "tools" / tool).exists():
            subprocess.run([sys.executable, f"tools/{tool}"], cwd=ROOT, check=True, capture_output=True)
    git("add", "-A", "--", *changed, "protos", "docs", "README.md")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="print the moves, change nothing")
    args = parser.parse_args()
    moves = plan()
    if not moves:
        print("nothing to move: the tree is regrouped")
        return 0
    check(moves)
    for m in moves:
        print(f"{m.old} -> {m.new} ({m.why})")
    if args.dry_run:
        return 0
    changed = apply(moves)
    tidy(changed)
    print(f"{len(moves)} files moved, {len(changed)} files rewritten; run make check and the tests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
