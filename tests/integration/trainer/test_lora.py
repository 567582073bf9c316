"""LoRA runs on a real trainer rank: only the adapters train and travel, checkpoints resume them
bit for bit, and the PEFT export is the policy: transformers + peft on it, the trainer's own model
and the engine serving the adapter (tp 1 and tp 2, beside requests on the bare base) give the same
log-probs within float tolerance; the merged export equals them too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from trainer_steps import make_step

from looprl.weightsync.v1.weightsync_pb2 import PushShardsRequest
from services.kit.config.recipe import parse_recipe
from services.kit.local.infra import free_port
from services.modeling import causal_lm, lora
from services.modeling.config import ModelConfig
from services.modeling.layouts import Layout, hf_params, shard_state_dict
from services.modeling.logprobs import token_logprobs
from services.modeling.tp_local import LocalTPGroup
from services.trainer.shards import reassemble
from services.trainer.spec import spec_from_recipe
from services.trainer.worker import TrainerWorker
from tools.build_hf_model import build

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow  # real trainer ranks train; peft loads the exports

TARGETS = '["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]'


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "base"
    build(
        out,
        seed=3,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        head_dim=16,
        vocab_size=400,
        init_std=0.1,
    )
    return out


def _recipe(base: Path, merge: bool = False) -> str:
    return (
        f'[run]\nname = "lora"\nseed = 5\nsteps = 4\n[model]\npath = "{base}"\ntokenizer = "{base}"\n'
        f"[model.lora]\nrank = 4\nalpha = 8.0\ntarget_modules = {TARGETS}\nmerge_on_export = {str(merge).lower()}\n"
        "[optimizer]\nlr = 5e-3\n"
    )


def _worker(recipe_text: str) -> TrainerWorker:
    worker = TrainerWorker(rank=0, world_size=1, threads=1)
    worker.init_process_group("127.0.0.1", free_port(), timeout_s=60)
    worker.setup(spec_from_recipe(parse_recipe(recipe_text), "lora-run"))
    return worker


def _state(worker: TrainerWorker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in worker.full_state_dict().items()}


def _steps(worker: TrainerWorker, steps: range) -> None:
    for step in steps:
        worker.train_step(
            make_step(step=step, world_size=1, micro_per_rank=1, seqs_per_micro=4, seed=20 + step)[0][0]
        )


def test_only_the_adapters_train_travel_and_resume_exactly(base, tmp_path):
    worker = _worker(_recipe(base))
    try:
        before = _state(worker)
        _steps(worker, range(2))
        after = _state(worker)
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        assert changed and all(lora.is_adapter_param(k) for k in changed)  # the base never moves
        assert any(".lora_B." in k for k in changed)

        # A version is the adapter's tensors only, under the adapter config weight-sync plans by.
        pushed = reassemble(PushShardsRequest.FromString(r) for r in worker.shard_requests(2))
        adapter_config = worker.model.config.with_lora(lora.LoraSpec(4, 8.0, tuple(json.loads(TARGETS))))
        assert set(pushed) == set(hf_params(adapter_config))
        base_bytes = sum(v.numel() for k, v in after.items() if not lora.is_adapter_param(k)) * 4
        assert sum(t.numel() * t.element_size() for t in pushed.values()) * 10 < base_bytes

        path = worker.save_checkpoint(str(tmp_path / "ckpt"))
        _steps(worker, range(2, 4))
        expected = _state(worker)
    finally:
        worker.shutdown()
    resumed = _worker(_recipe(base))
    try:
        resumed.load_checkpoint(path)
        assert resumed.step == 2
        _steps(resumed, range(2, 4))
        again = _state(resumed)
    finally:
        resumed.shutdown()
    assert all(torch.equal(expected[k], again[k]) for k in expected)


def test_engine_with_the_adapter_equals_trainer_and_transformers_peft_on_the_export(base, tmp_path):
    worker = _worker(_recipe(base, merge=True))
    out = tmp_path / "export"
    try:
        _steps(worker, range(2))
        worker.export_hf(str(out))
        ids = torch.tensor(
            make_step(step=9, world_size=1, micro_per_rank=1, seqs_per_micro=1, seed=9)[1][0].tokens
        )
        with torch.no_grad():
            worker.model.eval()
            trainer_logp = token_logprobs(worker.model(ids), ids, torch.tensor([0, len(ids)]))
    finally:
        worker.shutdown()
    cu = torch.tensor([0, len(ids)])

    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf_base, out).eval()
    with torch.no_grad():
        peft_logp = token_logprobs(with_adapter(input_ids=ids[None]).logits[0], ids, cu)
    torch.testing.assert_close(trainer_logp, peft_logp, atol=1e-5, rtol=0)

    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        merged_logp = token_logprobs(merged(input_ids=ids[None]).logits[0], ids, cu)
    torch.testing.assert_close(merged_logp, peft_logp, atol=1e-4, rtol=0)

    spec, adapter = lora.load_peft(out)
    config: ModelConfig = causal_lm.read_config(base)
    adapter_config = config.with_lora(spec)
    base_sd = causal_lm.load(base).hf_state_dict()
    for layout in (Layout(1, "hf"), Layout(2, "fused")):
        group = LocalTPGroup(config, layout, max_slots=2, max_len=len(ids) + 1)
        group.load_full_state_dict(base_sd)
        for r, model in enumerate(group.models):
            model.load_adapter("run-a", adapter_config, shard_state_dict(adapter, adapter_config, layout, r))
        slots = [group.allocate(), group.allocate()]
        adapted, bare = group.run(
            lambda m, c, slots=slots: m.prefill_batch(
                c, slots, [ids, ids], [0, 0], all_logits=True, adapters=["run-a", None]
            )
        )[0]
        group.close()
        torch.testing.assert_close(token_logprobs(adapted, ids, cu), peft_logp, atol=1e-4, rtol=0)
        with torch.no_grad(), with_adapter.disable_adapter():
            hf_base_logp = token_logprobs(with_adapter(input_ids=ids[None]).logits[0], ids, cu)
        # requests on the bare base, in the same batch, get the base's log-probs
        torch.testing.assert_close(token_logprobs(bare, ids, cu), hf_base_logp, atol=1e-4, rtol=0)
        assert not torch.allclose(hf_base_logp, peft_logp, atol=1e-3)  # the adapter changed the policy


def _fsdp_rank(rank: int, port: int, base: str, results) -> None:
    worker = TrainerWorker(rank=rank, world_size=2, threads=1)
    worker.init_process_group("127.0.0.1", port, timeout_s=60)
    try:
        text = _recipe(Path(base)).replace("[optimizer]", "[trainer]\nworld_size = 2\n[optimizer]")
        worker.setup(spec_from_recipe(parse_recipe(text), "lora-fsdp"))
        before = {k: v.clone() for k, v in (worker.full_state_dict() or {}).items()}
        for step in range(2):
            worker.train_step(
                make_step(step=step, world_size=2, micro_per_rank=1, seqs_per_micro=4, seed=20 + step)[0][
                    rank
                ]
            )
        after = worker.full_state_dict()
        pushed = [PushShardsRequest.FromString(r) for r in worker.shard_requests(2)]
        if rank == 0:
            changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
            results.put((changed, sorted({c.name for r in pushed for c in r.shards})))
    finally:
        worker.shutdown()


def test_two_fsdp_ranks_train_and_push_only_the_adapters(base):
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_fsdp_rank, args=(free_port(), str(base), results), nprocs=2)
    changed, pushed = results.get()
    assert changed and all(lora.is_adapter_param(k) for k in changed)
    assert pushed and all(lora.is_adapter_param(k) for k in pushed)
