"""Regenerate Python code from protos/ (messages, gRPC stubs, .pyi), or check it is fresh.

Generated files live beside their .proto, so `looprl.<domain>.v1.<file>_pb2` imports
without rewriting. `--check` regenerates into a temporary tree and fails on any difference.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out_dir: Path, protos: Path = PROTOS) -> None:
    """Run protoc over every .proto under `protos`, writing into out_dir."""
    include = Path(protoc.__file__).parent / "_proto"
    # protoc finds the mypy plugins on PATH; they are installed beside this interpreter.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    sources = sorted(str(p.relative_to(protos)) for p in protos.rglob("*.proto"))
    args = [
        "protoc",
        f"-I{protos}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")
    for directory in {(out_dir / s).parent for s in sources}:
        for parent in [directory, *directory.parents]:
            if parent == out_dir:
                break
            (parent / "__init__.py").touch()


def generated_files(tree: Path) -> set[Path]:
    return {
        p.relative_to(tree)
        for p in tree.rglob("*")
        if p.name.endswith(GENERATED_SUFFIXES) or p.name == "__init__.py"
    }


def stale_files(protos: Path = PROTOS) -> list[str]:
    """Generated files that differ from what the .proto files generate now (or are missing/extra)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh, protos)
        want, have = generated_files(fresh), generated_files(protos)
        stale = sorted(str(p) for p in want ^ have)
        stale += sorted(str(p) for p in want & have if not filecmp.cmp(fresh / p, protos / p, shallow=False))
    return stale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    parser.add_argument("--root", type=Path, default=PROTOS, help="proto tree (default: protos/)")
    args = parser.parse_args()
    if not args.check:
        generate(args.root, args.root)
        return
    stale = stale_files(args.root)
    if stale:
        sys.exit("generated code is stale (run `make protos`):\n  " + "\n  ".join(stale))
    print("generated code is fresh")


if __name__ == "__main__":
    main()
