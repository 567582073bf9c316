"""The contracts: generated code is fresh, a stale tree is caught, and buf lint passes."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.gen_protos import stale_files  # noqa: E402


def test_committed_generated_code_is_fresh() -> None:
    assert stale_files() == []


def test_check_fails_when_a_proto_changed_without_regenerating(tmp_path: Path) -> None:
    tree = tmp_path / "protos"
    shutil.copytree(ROOT / "protos", tree)
    proto = tree / "looprl" / "reward" / "v1" / "reward.proto"
    proto.write_text(
        proto.read_text().replace(
            "  string transcript = 5;", "  string transcript = 5;\n  string extra = 99;"
        )
    )
    assert "looprl/reward/v1/reward_pb2.py" in stale_files(tree)
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--check", "--root", str(tree)],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "stale" in result.stderr


def test_buf_lint_is_clean() -> None:
    buf = Path(sys.executable).parent / "buf"
    if not buf.exists():
        pytest.skip("buf not installed")
    result = subprocess.run([str(buf), "lint"], cwd=ROOT / "protos", capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_modules_import_by_their_proto_package() -> None:
    from looprl.gateway.v1 import gateway_pb2_grpc
    from looprl.inference.v1 import inference_pb2

    assert inference_pb2.DESCRIPTOR.package == "looprl.inference.v1"
    assert hasattr(gateway_pb2_grpc, "GatewayServiceStub")
