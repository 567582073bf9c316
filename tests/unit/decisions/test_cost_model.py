"""Cost models: a named GPU's roofline behaves like one; a measured cost-model file is checked field
by field, and its fit reproduces the points it was measured at."""

from __future__ import annotations

import json

import pytest

from services.decisions.cost_model import (
    FORMAT,
    GPUS,
    MODELS,
    CostModelError,
    MeasuredCost,
    RooflineCost,
    cost_model,
    decode_tokens_per_s,
    prefill_tokens_per_s,
    read_cost_file,
    write_cost_file,
)


def measured_file(prefill=(0.002, 1e-5, 2e-9), decode=(0.004, 2e-5, 1e-8)) -> dict:
    """A file as the measuring tool writes it, from known costs."""
    a, b, c = prefill
    da, db, dc = decode
    return {
        "format": FORMAT,
        "device": "NVIDIA H100 80GB HBM3",
        "device_kind": "cuda",
        "dtype": "bfloat16",
        "model": {"name": "qwen2.5-0.5b", "num_hidden_layers": 24, "num_key_value_heads": 2, "head_dim": 64},
        "prefill": [
            {"batch": bsz, "prompt_tokens": n, "seconds": a + b * bsz * n + c * bsz * n * n}
            for bsz in (1, 4, 16)
            for n in (64, 512, 4096)
        ],
        "decode": [
            {"batch": bsz, "context_tokens": n, "seconds_per_step": da + db * bsz + dc * bsz * n}
            for bsz in (1, 8, 64, 256)
            for n in (64, 1024, 4096)
        ],
        "train": [{"tokens": 8192, "tokens_per_s": 50_000.0}],
        "transfer": {"kv_gb_per_s": 100.0, "cuda_ipc_gb_per_s": 900.0, "device_copy_gb_per_s": 1200.0},
        "created_by": "tools/gpu_torch_check.py",
    }


def test_a_written_file_reads_back_and_its_fit_reproduces_the_measured_points(tmp_path):
    path = write_cost_file(tmp_path / "h100.json", measured_file())
    cost = read_cost_file(path)
    assert isinstance(cost, MeasuredCost) and cost.name == "NVIDIA H100 80GB HBM3"
    for point in json.loads(path.read_text())["prefill"]:
        got = cost.prefill_seconds([point["prompt_tokens"]] * point["batch"])
        assert got == pytest.approx(point["seconds"], rel=1e-6)
    for point in json.loads(path.read_text())["decode"]:
        got = cost.decode_step_seconds(point["batch"], point["batch"] * point["context_tokens"])
        assert got == pytest.approx(point["seconds_per_step"], rel=1e-6)
    # KV of 512 tokens: 2 x 24 layers x 2 heads x 64 x 2 bytes each, at 100 GB/s.
    assert cost.kv_transfer_seconds(512) == pytest.approx(512 * 2 * 24 * 2 * 64 * 2 / 100e9)


def test_noisy_points_never_fit_a_negative_cost(tmp_path):
    data = measured_file(prefill=(0.0, 1e-5, 0.0), decode=(0.01, 0.0, 0.0))
    for point in data["decode"]:
        point["seconds_per_step"] *= 1.0 + 0.01 * (point["batch"] % 3 - 1)  # noise, no batch trend
    cost = MeasuredCost.from_data(data)
    assert min(cost.prefill_coef) >= 0 and min(cost.decode_coef) >= 0
    assert cost.decode_step_seconds(64, 64 * 1024) == pytest.approx(0.01, rel=0.05)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.update(format="other/1"), "format"),
        (lambda d: d.update(device=""), "device"),
        (lambda d: d.update(device_kind="tpu"), "device_kind"),
        (lambda d: d.update(prefill=[]), "prefill"),
        (lambda d: d["prefill"][1].update(seconds=-1.0), r"prefill\[1\]\.seconds"),
        (lambda d: d["decode"][0].pop("batch"), r"decode\[0\]\.batch"),
        (lambda d: d["decode"][2].update(context_tokens=float("nan")), r"decode\[2\]\.context_tokens"),
        (lambda d: d["train"][0].update(tokens_per_s="fast"), r"train\[0\]\.tokens_per_s"),
        (lambda d: d.update(transfer={"kv_gb_per_s": 0}), r"transfer\.kv_gb_per_s"),
    ],
)
def test_a_bad_file_is_refused_naming_the_field(tmp_path, change, field):
    data = measured_file()
    change(data)
    with pytest.raises(CostModelError, match=field):
        write_cost_file(tmp_path / "bad.json", data)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(CostModelError, match=field):
        read_cost_file(tmp_path / "bad.json")


def test_missing_or_broken_files_and_unknown_names_say_so(tmp_path):
    with pytest.raises(CostModelError, match="does not exist"):
        read_cost_file(tmp_path / "none.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(CostModelError, match="not valid JSON"):
        read_cost_file(tmp_path / "x.json")
    with pytest.raises(CostModelError, match="unknown GPU 'B300'"):
        cost_model("roofline:B300")
    with pytest.raises(CostModelError, match="unknown model shape"):
        cost_model("roofline:H100", "gpt-5")


def test_the_roofline_is_compute_bound_in_prefill_and_bandwidth_bound_in_small_decode_batches():
    h100, h200 = (RooflineCost(GPUS[g], MODELS["qwen2.5-7b"]) for g in ("H100", "H200"))
    # Same FLOP/s: prefill equal; H200's faster memory decodes faster at every batch.
    assert prefill_tokens_per_s(h100, 2048, 4) == pytest.approx(prefill_tokens_per_s(h200, 2048, 4))
    for batch in (1, 32, 256):
        assert decode_tokens_per_s(h200, batch, 2048) > decode_tokens_per_s(h100, batch, 2048)
    # A prefill token costs far less than a decode token at batch 1; batching decode closes much of it.
    ratio_1 = prefill_tokens_per_s(h100, 2048) / decode_tokens_per_s(h100, 1, 2048)
    ratio_128 = prefill_tokens_per_s(h100, 2048) / decode_tokens_per_s(h100, 128, 2048)
    assert ratio_1 > 100 and ratio_128 < ratio_1 / 20
    # Longer contexts make decode steps slower (KV reads) and prefill tokens dearer (attention).
    assert decode_tokens_per_s(h100, 64, 8192) < decode_tokens_per_s(h100, 64, 512)
    assert prefill_tokens_per_s(h100, 16384) < prefill_tokens_per_s(h100, 512)
    assert 0 < h100.kv_capacity_tokens() < 80 * 2**30 // h100.model.kv_bytes_per_token
    assert cost_model("roofline:H100").name == GPUS["H100"].name
