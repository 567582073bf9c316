"""User code as plugins: what a recipe names by import path or entry point, loaded by the service
that runs it (environment-sandbox, reward), never by the gateway.

A reference is one of
- `path/to/file.py:Name`: a Python file, relative to one of the service's plugin directories (or
  an absolute path inside one);
- `package.module:Name`: a module found in a plugin directory, or one of an installed distribution
  that declares a `looprl.*` entry point;
- `name`: an entry point of the group (`looprl.environments`, `looprl.rewards`,
  `looprl.task_sources`) declared by an installed distribution or by a `.dist-info` in a plugin
  directory.

Only code the operator placed is loadable: a plugin directory is a service setting
(`LOOPRL_PLUGIN_DIRS`, put on the service's `sys.path`), and a distribution opts in by declaring a
looprl entry point; a recipe cannot make a service import `os:system`. Neither can it reach such code
through a plugin: what a reference names must be defined in a plugin directory's code (not
`rewards.py:os.system` because rewards.py imported os), it walks no private attribute, and a package
outside the plugin directories is not imported to look for a module in it. A file outside them
answers as a missing one. Plugins run in the service's process with its permissions (they are the
operator's code, unlike the model's code, which runs in the sandbox).

Every failure is a PluginError naming the reference, what failed (import, its kind, its config, a
trial call) and where: the plugin's file and line, from the traceback.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENVIRONMENTS_GROUP = "looprl.environments"
REWARDS_GROUP = "looprl.rewards"
TASK_SOURCES_GROUP = "looprl.task_sources"

_LOCK = threading.Lock()
# A plugin's exception text travels in gRPC status details and run errors: bounded.
MAX_MESSAGE_CHARS = 2000


class PluginError(ValueError):
    """A plugin could not be loaded, validated or called; the message names it, the file and the
    line, and the cause."""


class PluginExit(Exception):
    """Plugin code raised SystemExit, KeyboardInterrupt or another BaseException that is no
    Exception (its `__cause__`): the plugin's failure, which must not end the service running it."""


# What passes through plugin error handling untouched: the machinery's own, never a plugin's failure.
PASSED_THROUGH = (asyncio.CancelledError, GeneratorExit)


def call_contained(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) where a BaseException that is no Exception becomes a PluginExit (in a
    worker thread, or an asyncio task, asyncio would re-raise SystemExit into the event loop)."""
    try:
        return fn(*args, **kwargs)
    except (Exception, *PASSED_THROUGH):
        raise
    except BaseException as exc:
        raise PluginExit(type(exc).__name__) from exc


async def await_contained(awaitable: Any) -> Any:
    """`await awaitable`, where a BaseException that is no Exception becomes a PluginExit."""
    try:
        return await awaitable
    except (Exception, *PASSED_THROUGH):
        raise
    except BaseException as exc:
        raise PluginExit(type(exc).__name__) from exc


def is_reference(name: str) -> bool:
    """Whether `name` is an import path (`module:Name`, `file.py:Name`) rather than a plain name."""
    return ":" in name


@dataclass(frozen=True)
class Loaded:
    """A loaded plugin object and where it came from (for messages and ListEnvironments)."""

    reference: str
    obj: Any
    origin: str  # the file, or "entry point NAME = VALUE (DIST VERSION)"
    root: str  # the directory the plugin's own frames live under (for error locations)


def plugin_dirs_from(value: str | Sequence[str]) -> tuple[Path, ...]:
    """Plugin directories from a setting: a list, or an os.pathsep- or comma-separated string."""
    if isinstance(value, str):
        parts = [p for chunk in value.split(os.pathsep) for p in chunk.split(",")]
    else:
        parts = list(value)
    return tuple(Path(p).resolve() for p in parts if p and p.strip())


def add_to_path(dirs: Sequence[Path]) -> None:
    """Put the plugin directories on sys.path (a plugin imports its sibling modules as usual)."""
    for d in dirs:
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))


def where(exc: BaseException, root: str = "") -> str:
    """'file:line' of the frame that raised inside the plugin (under `root`), else the deepest frame
    outside this package; a SyntaxError's own location."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if root and f.filename.startswith(root)]
    if inside:
        frame = inside[-1]
    else:
        ours = str(Path(__file__).resolve().parents[2])
        outside = [f for f in frames if not f.filename.startswith(ours) and "importlib" not in f.filename]
        if not outside:
            return ""
        frame = outside[-1]
    return f"{frame.filename}:{frame.lineno}"


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as broken:  # plugin code's __str__ is plugin code too
        return f"<its message could not be shown: {type(broken).__name__}>"


def describe(exc: BaseException, root: str = "") -> str:
    """'<file:line>: <Type>: <message>' of an exception raised by plugin code, at most
    MAX_MESSAGE_CHARS long."""
    if isinstance(exc, PluginExit) and exc.__cause__ is not None:
        exc = exc.__cause__
    location = where(exc, root)
    text = f"{type(exc).__name__}: {_message(exc)}"
    text = f"{location}: {text}" if location else text
    if len(text) > MAX_MESSAGE_CHARS:
        cut = MAX_MESSAGE_CHARS - 60
        text = f"{text[:cut]}... ({len(text) - cut} characters left out)"
    return text


def _inside(path: Path, dirs: Sequence[Path]) -> bool:
    return any(path == d or d in path.parents for d in dirs)


def _opted_in(module: str) -> bool:
    """Whether the module's top-level package belongs to a distribution declaring a looprl entry point."""
    top = module.split(".")[0]
    for dist_name in importlib.metadata.packages_distributions().get(top, []):
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if any(ep.group.startswith("looprl.") for ep in dist.entry_points):
            return True
    return False


def _load_file(path: Path, attr: str, reference: str, dirs: Sequence[Path]) -> Loaded:
    stamp = path.stat().st_mtime_ns
    name = f"looprl_plugin_{abs(hash((str(path), stamp))):x}_{path.stem}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise PluginError(f"{reference!r}: {path} is not a loadable Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:
            sys.modules.pop(name, None)
            raise PluginError(f"{reference!r} failed to import: {describe(exc, str(path.parent))}") from None
    obj = _attribute(module, attr, reference, str(path), dirs)
    return Loaded(reference, obj, str(path), str(path.parent))


def _attribute(
    module: Any, attr: str, reference: str, origin: str, dirs: Sequence[Path], trusted: bool = False
) -> Any:
    """The object `attr` names in `module`. Unless `trusted` (an entry point the operator declared),
    it must be code of a plugin directory or of an opted-in distribution: a reference cannot walk
    into a module the plugin imported, nor through private attributes (`__globals__`)."""
    obj: Any = module
    for part in attr.split("."):
        if not trusted and part.startswith("_"):
            raise PluginError(f"{reference!r}: {part!r} is a private attribute, not a plugin")
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{reference!r}: {origin} has no attribute {attr!r}") from None
        if not trusted and inspect.ismodule(obj):
            raise PluginError(
                f"{reference!r}: {part!r} is the module {obj.__name__!r}, which {origin} imported: "
                "not code of a plugin directory (name a module in one by its own import path)"
            )
    if not trusted:
        defined_in = getattr(obj, "__module__", None) or type(obj).__module__
        if not _placed(defined_in, dirs):
            raise PluginError(
                f"{reference!r}: {attr!r} is {kind_of(obj)} of module {defined_in!r}, which {origin} "
                "imported: not code of a plugin directory (wrap it in a function of your own)"
            )
    return obj


def _placed(module_name: str | None, dirs: Sequence[Path]) -> bool:
    """Whether a loaded module is code the operator placed: a file in a plugin directory, or a
    module of a distribution that declares a looprl entry point."""
    module = sys.modules.get(module_name or "")
    path = getattr(module, "__file__", None)
    if not path:
        return False
    return _inside(Path(path).resolve(), dirs) or _opted_in(module_name or "")


def _located(spec: importlib.machinery.ModuleSpec | None) -> list[Path]:
    """Where a module spec's code lies: its file, or a (namespace) package's directories."""
    if spec is None:
        return []
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return [Path(spec.origin).resolve()]
    return [Path(p).resolve() for p in spec.submodule_search_locations or []]


def _load_module(
    module_name: str, attr: str, reference: str, dirs: Sequence[Path], trusted: bool = False
) -> Loaded:
    refused = PluginError(
        f"{reference!r}: module {module_name!r} is neither in a plugin directory of this service "
        f"(LOOPRL_PLUGIN_DIRS: {', '.join(str(d) for d in dirs) or 'none configured'}) nor in an "
        "installed package declaring a looprl entry point"
    )
    try:
        # Locating `pkg.sub` imports `pkg`: its top-level package is located first, which imports
        # nothing, and refused unless the operator placed it.
        top = module_name.partition(".")[0]
        top_places = _located(importlib.util.find_spec(top))
    except (ImportError, ValueError):
        raise refused from None
    if not (any(_inside(p, dirs) for p in top_places) or _opted_in(top)):
        raise refused
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise PluginError(f"{reference!r} failed to import: {describe(exc)}") from None
    located = _located(spec)
    if spec is None or not (any(_inside(p, dirs) for p in located) or _opted_in(module_name)):
        raise refused
    origin = spec.origin or ""
    root = str(located[0].parent) if spec.origin and located else ""
    try:
        module = importlib.import_module(module_name)
    except BaseException as exc:
        raise PluginError(f"{reference!r} failed to import: {describe(exc, root)}") from None
    return Loaded(reference, _attribute(module, attr, reference, origin, dirs, trusted), origin, root)


def _entry_point(group: str, name: str) -> importlib.metadata.EntryPoint | None:
    found = [ep for ep in importlib.metadata.entry_points(group=group) if ep.name == name]
    return found[0] if found else None


def entry_point_names(group: str) -> list[str]:
    return sorted({ep.name for ep in importlib.metadata.entry_points(group=group)})


def load(reference: str, group: str, dirs: Sequence[Path]) -> Loaded:
    """Load what `reference` names (see the module docstring); PluginError says why not."""
    with _LOCK:  # imports of one process one at a time: sys.path and sys.modules are shared
        add_to_path(dirs)
        importlib.invalidate_caches()
        if not is_reference(reference):
            ep = _entry_point(group, reference)
            if ep is None:
                known = ", ".join(entry_point_names(group)) or "none"
                raise PluginError(
                    f"{reference!r}: no entry point of that name in {group} (declared: {known})"
                )
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "?"
            origin = f"entry point {ep.name} = {ep.value} ({dist})"
            module_name, _, attr = ep.value.partition(":")
            loaded = (
                _load_module(module_name.strip(), attr.strip(), reference, dirs, trusted=True)
                if attr
                else None
            )
            if loaded is None:
                raise PluginError(f"{reference!r}: {origin} names no attribute (module:Name)")
            return Loaded(reference, loaded.obj, origin, loaded.root)
        target, _, attr = reference.rpartition(":")
        if not target or not attr:
            raise PluginError(f"{reference!r}: expected 'module:Name' or 'file.py:Name'")
        if target.endswith(".py"):
            path = Path(target)
            candidates = [path] if path.is_absolute() else [d / path for d in dirs]
            for candidate in candidates:
                try:
                    resolved = candidate.resolve()
                    # A file outside the plugin directories answers as a missing one: the message
                    # must not tell a recipe which files exist on the service's host.
                    found = _inside(resolved, dirs) and resolved.is_file()
                except (OSError, ValueError):  # a name no file can have (a NUL byte, too long)
                    found = False
                if found:
                    return _load_file(resolved, attr, reference, dirs)
            searched = ", ".join(str(d) for d in dirs) or "none configured"
            raise PluginError(f"{reference!r}: no file {target!r} in the plugin directories ({searched})")
        return _load_module(target, attr, reference, dirs)


def kind_of(obj: Any) -> str:
    """What an object is, in a few words ("a function", "the class Foo", "a dict")."""
    if inspect.isclass(obj):
        return f"the class {obj.__qualname__}"
    if inspect.isroutine(obj):
        return f"the function {getattr(obj, '__qualname__', obj)}"
    return f"a {type(obj).__name__}"


def call_site(obj: Any) -> str:
    """'file:line' where a plugin object is defined (for messages about its signature or schema)."""
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (OSError, TypeError):
        return ""
