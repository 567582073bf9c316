"""The read-only Python runtime of workspace sandboxes: an interpreter, pytest, and the workspace tools.

A workspace command runs `python` from /opt/looprl/bin (first on PATH). That is a virtual
environment over the service's own interpreter holding only the declared packages (pytest and what
it requires, copied from the service's environment, where pytest is a runtime dependency) plus
`looprl_tools.py` (ws_tools.py: read, write, search, apply a patch). It is built once per host
and package set under the sandbox root, atomically, and bound read-only into every workspace
sandbox; nothing of the service's environment (torch, grpc, the project's code) is visible there.

`looprl_workspace.pth` appends /workspace to sys.path after site-packages: the repository's
packages import from anywhere, as an editable install would, but a module the agent names `pytest`
or `json` never shadows the real one.
"""

from __future__ import annotations

import compileall
import hashlib
import importlib.metadata as metadata
import os
import shutil
import sys
import tempfile
from pathlib import Path

from services.environment_sandbox.sandbox.job import SandboxError

TOOLS_SOURCE = Path(__file__).with_name("ws_tools.py")
TOOLS_NAME = "looprl_tools.py"
SANDBOX_PATH = "/opt/looprl"  # where workspace_init.py binds it


def _requirements(names: tuple[str, ...]) -> list[metadata.Distribution]:
    """The distributions `names` need, their requirements included (markers evaluated here)."""
    from packaging.requirements import Requirement

    found: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SandboxError(
                f"sandbox.workspace.runtime_packages: {name!r} is not installed in the service's environment"
            ) from None
        found[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(found.values(), key=lambda d: d.metadata["Name"].lower())


def _fingerprint(dists: list[metadata.Distribution], interpreter: str) -> str:
    digest = hashlib.sha256(interpreter.encode())
    for dist in dists:
        digest.update(f"{dist.metadata['Name']}=={dist.version};".encode())
    digest.update(TOOLS_SOURCE.read_bytes())
    return digest.hexdigest()[:16]


def build_runtime(root: Path, packages: tuple[str, ...], python: str = "") -> Path:
    """The runtime directory for `packages` under `root`, built if missing (concurrent builders
    race to one rename; the loser's copy is discarded)."""
    interpreter = os.path.realpath(python or sys.executable)
    dists = _requirements(packages)
    target = root / f"runtime-{_fingerprint(dists, interpreter)}"
    if (target / "pyvenv.cfg").is_file():
        return target
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    staging = Path(tempfile.mkdtemp(prefix=".runtime-", dir=root))
    try:
        site = staging / "lib" / version / "site-packages"
        site.mkdir(parents=True)
        (staging / "bin").mkdir()
        os.symlink(interpreter, staging / "bin" / "python")
        os.symlink("python", staging / "bin" / "python3")
        (staging / "pyvenv.cfg").write_text(
            f"home = {os.path.dirname(interpreter)}\ninclude-system-site-packages = false\n"
            f"version = {'.'.join(map(str, sys.version_info[:3]))}\n"
        )
        for dist in dists:
            for rel in dist.files or []:
                if ".." in rel.parts or rel.suffix == ".pyc":
                    continue  # scripts outside site-packages; bytecode is compiled below
                source = Path(dist.locate_file(rel))
                if source.is_file():
                    dest = site / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(source, dest)
        (site / "looprl_workspace.pth").write_text("/workspace\n")
        shutil.copyfile(TOOLS_SOURCE, staging / TOOLS_NAME)
        # Bytecode now, once: the runtime is read-only in the sandbox, so pytest would otherwise be
        # compiled from source on every test run.
        compileall.compile_dir(str(staging), quiet=2, workers=1)
        for path in [staging, *staging.rglob("*")]:
            if not path.is_symlink():
                path.chmod(0o755 if path.is_dir() else 0o644)
        try:
            staging.rename(target)
        except OSError:  # another pool built it first
            if not (target / "pyvenv.cfg").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
