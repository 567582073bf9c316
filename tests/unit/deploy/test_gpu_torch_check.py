"""tools/gpu_torch_check.py without a GPU: on an interpreter that can import only what a bare CUDA
image holds (torch, numpy, xxhash, grpcio, protobuf: no Ray, vLLM, pydantic, OpenTelemetry or
pytest), its CPU parts run (parity, the training step, the weight transport between two processes,
the engine measured) and write a cost-model file the simulator and the tuner read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.decisions.cost_model import read_cost_file
from services.decisions.pd_ratio import LengthStats, rates_from_cost_model
from tools.gpu_torch_check import gpu_test_modules

ROOT = Path(__file__).resolve().parents[3]
# What the image does not have, refused at import as if absent.
BARE_IMAGE = """
import sys
ABSENT = {"ray", "vllm", "pydantic", "pydantic_core", "opentelemetry", "prometheus_client", "nats",
          "aiohttp", "cryptography", "jinja2", "matplotlib", "pytest"}
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, _Absent())
"""


@pytest.mark.slow
def test_the_cpu_parts_run_on_a_bare_image_and_write_a_cost_model(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BARE_IMAGE)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.gpu_torch_check", "--cpu", "--out", str(out), "--budget-s", "120"],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "site"), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert {"pydantic", "opentelemetry", "ray", "vllm"} <= set(summary["environment"]["absent"])
    assert summary["tests"]["status"] == "skipped" and "needs CUDA" in summary["tests"]["why"]
    for section in ("parity", "train", "transport", "engine"):
        assert summary[section]["status"] == "passed", summary[section]
    parity = summary["parity"]["results"]
    assert parity["qwen2-10m/float32"]["logprob_max_abs_diff"] == 0.0  # the CPU against itself
    assert parity["qwen2-10m/bfloat16"]["logprob_max_abs_diff"] < 0.15
    transport = summary["transport"]
    assert transport["tensors_equal"] == transport["tensors"] > 100 and transport["committed_version"] == 0
    # The cost model reads back, names what was measured, and gives the tuner stage speeds.
    cost = read_cost_file(out / "cost_qwen2-10m.json")
    data = cost.data
    assert data["device_kind"] == "cpu" and data["device"].startswith("cpu: ")
    assert data["model"]["name"] == "qwen2-10m" and data["model"]["num_hidden_layers"] == 12
    assert data["train"][0]["tokens_per_s"] > 0 and data["transport"]["kv_gb_per_s"] > 0
    assert len(data["prefill"]) == len(data["decode"]) >= 1
    rates = rates_from_cost_model(cost, LengthStats(64, 64, 32), max_decode_batch=16)
    assert rates.prefill_tokens_per_s > 0 and all(t > 0 for _, t in rates.decode_points)


def test_the_tests_it_runs_on_a_gpu_need_neither_ray_nor_vllm():
    modules = {m.name for m in gpu_test_modules()}
    assert {"test_modeling_engine.py", "test_weightsync_gpu.py"} <= modules
    assert "test_engine_vllm.py" not in modules
