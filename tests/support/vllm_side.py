"""vLLM's own Python sources beside our torch, for CPU tests of what looprl hands to vLLM.

The pinned vLLM wheel (requirements/vllm.txt) is CUDA-only and pins another torch, so it is never
installed into the project's environment. `side_dir()` installs it WITHOUT dependencies into
`.vllm-side/` at the repository root (once, by `make vllm-side`, which `make test` runs before
pytest, or on first use; pip's cache keeps the wheel), together with the two pure-Python or
self-contained libraries `vllm/v1/serial_utils.py` imports at module level (pyzmq, cloudpickle);
msgspec is a dev dependency of the project. Offline, the tests that need it skip; under CI they
fail with pip's error.

`load(name)` imports one vLLM module from there WITHOUT running `vllm/__init__.py` (which pulls in
the compiled, CUDA-bound parts): the packages on the way are created empty with their real
`__path__`, so every submodule imported is vLLM's real file. Modules in `STUBS` are replaced by
the minimal stand-ins defined there, each for a reason given beside it; tests say which they use.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIDE = ROOT / ".vllm-side"
SOURCES = ROOT / "requirements" / "vllm.txt"
SIDE_DEPS = ("pyzmq==27.1.0", "cloudpickle==3.1.2")


def vllm_pin() -> str:
    for line in SOURCES.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("vllm=="):
            return line
    raise AssertionError(f"{SOURCES}: no vllm== pin")


PIP_TIMEOUT_S = 900  # the whole install; pip's own --timeout bounds each network read


def in_ci() -> bool:
    """A CI run (CI=true, as CI services and .ci/run set it): a missing vLLM side is a failure there."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def install() -> str:
    """Install the pinned vLLM into SIDE unless it is there already; '' on success, else pip's error."""
    pin = vllm_pin()
    stamp = SIDE / ".installed"
    if stamp.exists() and stamp.read_text() == pin:
        return ""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--upgrade",
        "--timeout",
        "60",
        "--target",
        str(SIDE),
        pin,
        *SIDE_DEPS,
    ]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"pip did not finish within {PIP_TIMEOUT_S}s"
    if result.returncode != 0:
        return result.stderr.strip() or result.stdout.strip() or f"pip exited with {result.returncode}"
    stamp.write_text(pin)
    return ""


def side_dir() -> Path:
    """The side install of the pinned vLLM (installed on first use; `make test` installs it before
    pytest starts, so the download is not cut by pytest-timeout). When pip cannot get it the tests
    skip, except under CI, where they fail with pip's error: CI must not pass without them."""
    error = install()
    if error:
        why = f"the pinned {vllm_pin()} wheel could not be installed into {SIDE}:\n{error[-2000:]}"
        if in_ci():
            pytest.fail(f"CI: {why}", pytrace=False)
        pytest.skip(why)
    return SIDE


def _stub_modules() -> dict[str, types.ModuleType]:
    """Stand-ins for modules that cannot import beside our torch (compiled or CUDA-bound vLLM
    parts, or heavy graphs of them); none of them is part of what the tests check."""
    out: dict[str, types.ModuleType] = {}

    # vllm.config.parallel imports vllm.platforms (CUDA detection) and torch.distributed helpers;
    # base.py needs only the ParallelConfig name for a type annotation.
    parallel = types.ModuleType("vllm.config.parallel")

    class ParallelConfig:
        """Stand-in: base.py annotates `self.parallel_config: ParallelConfig`."""

    parallel.ParallelConfig = ParallelConfig
    out["vllm.config.parallel"] = parallel

    # vllm.multimodal.inputs drags in PIL/transformers-based multimodal processing; serial_utils
    # needs its classes only for isinstance checks that our plain dicts and lists never match.
    mm = types.ModuleType("vllm.multimodal.inputs")
    for name in (
        "BaseMultiModalField",
        "MultiModalBatchedField",
        "MultiModalFieldConfig",
        "MultiModalFieldElem",
        "MultiModalFlatField",
        "MultiModalKwargsItem",
        "MultiModalKwargsItems",
        "MultiModalSharedField",
    ):
        setattr(mm, name, type(name, (), {}))
    mm.NestedTensors = object
    out["vllm.multimodal.inputs"] = mm

    # vllm.utils.torch_utils imports compiled vLLM ops; serial_utils reads PIN_MEMORY (tensors only).
    torch_utils = types.ModuleType("vllm.utils.torch_utils")
    torch_utils.PIN_MEMORY = False
    out["vllm.utils.torch_utils"] = torch_utils

    # vllm.v1.utils imports the engine graph; serial_utils uses tensor_data to encode tensors,
    # which looprl never hands to vLLM's msgpack path (a test asserts it).
    v1_utils = types.ModuleType("vllm.v1.utils")

    def tensor_data(tensor):
        raise AssertionError("a tensor reached vLLM's msgpack encoder")

    v1_utils.tensor_data = tensor_data
    out["vllm.v1.utils"] = v1_utils

    # vllm.utils.hashing imports cbor2 (not installed here); config modules use its safe_hash only
    # in compute_hash, which no test calls.
    hashing = types.ModuleType("vllm.utils.hashing")

    def safe_hash(data: bytes, usedforsecurity: bool = True):
        raise AssertionError("a test reached vLLM's safe_hash")

    hashing.safe_hash = safe_hash
    out["vllm.utils.hashing"] = hashing

    # vllm.logger configures logging from vllm.envs at import; a plain logger does for these tests.
    logger = types.ModuleType("vllm.logger")
    logger.init_logger = logging.getLogger
    out["vllm.logger"] = logger
    return out


STUBS = tuple(_stub_modules())


def _package(name: str, root: Path) -> types.ModuleType:
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__path__ = [str(root / Path(*name.split(".")))]
        module.__package__ = name
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    return module


def load(name: str) -> types.ModuleType:
    """Import vLLM module `name` from the side install (real file), without vllm/__init__.py."""
    root = side_dir()
    if str(root) not in sys.path:
        sys.path.append(str(root))  # after the project's own packages: our torch, numpy, pydantic win
    existing = sys.modules.get("vllm")
    if existing is not None and not str(getattr(existing, "__path__", [""])[0]).startswith(str(root)):
        raise AssertionError(f"another vllm is already imported: {existing!r}")
    parts = name.split(".")
    for i in range(1, len(parts)):
        _package(".".join(parts[:i]), root)
    for stub_name, stub in _stub_modules().items():
        if stub_name not in sys.modules:
            for i in range(1, len(stub_name.split("."))):
                _package(".".join(stub_name.split(".")[:i]), root)
            sys.modules[stub_name] = stub
    return importlib.import_module(name)


def source(relative: str) -> str:
    """The text of one file of the pinned vLLM (e.g. 'vllm/v1/engine/async_llm.py')."""
    return (side_dir() / relative).read_text()


if __name__ == "__main__":
    # `make vllm-side` (run by `make test` before pytest): install with pip's own timeouts. Exits 1
    # on failure under CI; elsewhere it warns and the tests that need the side install skip.
    problem = install()
    if problem:
        print(
            f"vllm-side: the pinned {vllm_pin()} could not be installed into {SIDE}:\n{problem}",
            file=sys.stderr,
        )
        sys.exit(1 if in_ci() else 0)
    print(SIDE)
