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
looprl entry point; a recipe cannot make a service import `os:system`. Plugins run in the service's
process with its permissions (they are the operator's code, unlike the model's code, which runs in
the sandbox).

Every failure is a PluginError naming the reference, what failed (import, its kind, its config, a
trial call) and where: the plugin's file and line, from the traceback.
"""

from __future__ import annotations

import importlib
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


class PluginError(ValueError):
    """A plugin could not be loaded, validated or called; the message names it, the file and the
    line, and the cause."""


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
        ours = str(Path(__file__).resolve().parents[1])
        outside = [f for f in frames if not f.filename.startswith(ours) and "importlib" not in f.filename]
        if not outside:
            return ""
        frame = outside[-1]
    return f"{frame.filename}:{frame.lineno}"


def describe(exc: BaseException, root: str = "") -> str:
    """'<file:line>: <Type>: <message>' of an exception raised by plugin code."""
    location = where(exc, root)
    text = f"{type(exc).__name__}: {exc}"
    return f"{location}: {text}" if location else text


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


def _load_file(path: Path, attr: str, reference: str) -> Loaded:
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
    return Loaded(reference, _attribute(module, attr, reference, str(path)), str(path), str(path.parent))


def _attribute(module: Any, attr: str, reference: str, origin: str) -> Any:
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{reference!r}: {origin} has no attribute {attr!r}") from None
    return obj


def _load_module(module_name: str, attr: str, reference: str, dirs: Sequence[Path]) -> Loaded:
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:
        raise PluginError(f"{reference!r} failed to import: {describe(exc)}") from None
    if spec is None:
        searched = ", ".join(str(d) for d in dirs) or "none configured"
        raise PluginError(
            f"{reference!r}: no module {module_name!r} (plugin directories: {searched}; "
            "installed packages declaring a looprl entry point)"
        )
    origin = spec.origin or ""
    located = Path(origin).resolve() if origin and origin not in ("built-in", "frozen") else None
    if not ((located is not None and _inside(located, dirs)) or _opted_in(module_name)):
        raise PluginError(
            f"{reference!r}: module {module_name!r} is neither in a plugin directory of this service "
            "(LOOPRL_PLUGIN_DIRS) nor in an installed package declaring a looprl entry point"
        )
    root = str(located.parent) if located is not None else ""
    try:
        module = importlib.import_module(module_name)
    except BaseException as exc:
        raise PluginError(f"{reference!r} failed to import: {describe(exc, root)}") from None
    return Loaded(reference, _attribute(module, attr, reference, origin), origin, root)


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
            loaded = _load_module(module_name.strip(), attr.strip(), reference, dirs) if attr else None
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
                resolved = candidate.resolve()
                if resolved.is_file():
                    if not _inside(resolved, dirs):
                        raise PluginError(
                            f"{reference!r}: {resolved} is not inside a plugin directory of this service "
                            "(LOOPRL_PLUGIN_DIRS)"
                        )
                    return _load_file(resolved, attr, reference)
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
