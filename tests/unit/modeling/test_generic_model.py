"""The generic path: transformers' own code on looprl's packed batches, its engine's KV cache, and
the layouts weight-sync plans it by."""

from __future__ import annotations

import pytest
import torch

from services.modeling.config import ModelConfig
from services.modeling.generic import GenericCausalLM, GenericEngineModel
from services.modeling.layouts import Layout, hf_params, rank_params
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.modeling.shared_prefix import share_prefixes

MISTRAL = ModelConfig.from_hf_dict(
    {
        "model_type": "mistral",
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 128,
        "sliding_window": None,
        "tie_word_embeddings": False,
    }
)


@pytest.fixture(scope="module")
def model() -> GenericCausalLM:
    m = GenericCausalLM(MISTRAL, seed=0).eval()
    m.init_weights(2, std=0.2)
    return m


def _pack(seqs):
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
    return ids, pos, cu


def test_a_packed_batch_equals_each_sequence_run_alone_by_transformers(model):
    assert MISTRAL.generic and not MISTRAL.tie_word_embeddings
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 97, (n,), generator=gen) for n in (6, 1, 11)]
    ids, pos, cu = _pack(seqs)
    with torch.no_grad():
        packed = model(ids, pos, cu)
        for i, s in enumerate(seqs):
            alone = model.hf(input_ids=s[None]).logits[0]
            torch.testing.assert_close(packed[cu[i] : cu[i + 1]], alone, atol=1e-5, rtol=1e-5)
        rows = torch.tensor([0, 7, 17])
        torch.testing.assert_close(model(ids, pos, cu, logits_at=rows), packed[rows], atol=1e-5, rtol=1e-5)


def test_shared_prompt_branches_give_the_unshared_logits(model):
    # The trainer computes a prompt several samples share once; the block mask lets each branch see
    # the prompt and its own tokens only.
    prompt = torch.tensor([5, 9, 2, 40])
    seqs = [torch.cat([prompt, torch.tensor(tail)]) for tail in ([1, 2, 3], [7, 8])]
    ids, pos, cu = _pack(seqs)
    layout = share_prefixes(ids, pos, cu, [4, 4])
    assert layout is not None
    with torch.no_grad():
        plain = model(ids, pos, cu)
        shared = model(layout.input_ids, layout.position_ids, layout.cu_seqlens, segments=layout.segments)
    torch.testing.assert_close(shared[layout.row_of], plain, atol=1e-5, rtol=1e-5)


def test_a_fast_path_model_forced_onto_the_generic_path_computes_the_same_function():
    fast = ModelConfig.tiny()
    ours = Qwen2ForCausalLM(fast, seed=3).eval()
    generic = GenericCausalLM(ModelConfig.from_hf_dict(fast.to_hf_dict(), "generic"), seed=None).eval()
    generic.load_hf_state_dict(ours.hf_state_dict())
    ids = torch.randint(0, fast.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(generic(ids), ours(ids), atol=1e-5, rtol=1e-5)


def test_engine_cache_prefill_decode_and_rewind_equal_a_full_forward(model):
    seq = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model.hf(input_ids=seq[None]).logits[0]
    engine = GenericEngineModel(MISTRAL, max_slots=2, max_len=32)
    engine.load(model.hf_state_dict())
    torch.testing.assert_close(engine.prefill(0, seq[:5], all_logits=True), full[:5], atol=1e-5, rtol=1e-5)
    for t in range(5, 9):
        torch.testing.assert_close(engine.decode([0], [int(seq[t])], [t])[0], full[t], atol=1e-5, rtol=1e-5)
    # a rewind drops the cached tail: the next turn is computed from position 6 on
    torch.testing.assert_close(
        engine.prefill(0, seq[6:12], start=6, all_logits=True), full[6:12], atol=1e-5, rtol=1e-5
    )
    with pytest.raises(ValueError, match="exceeds cached length"):
        engine.prefill(1, seq[:2], start=3)
    with pytest.raises(ValueError, match="token ids"):
        engine.prefill(1, torch.tensor([97]))


def test_weight_sync_plans_the_generic_model_whole_at_tp1_and_refuses_other_layouts(model):
    shapes = hf_params(MISTRAL)
    assert shapes == {name: tuple(p.shape) for name, p in model.named_parameters()}
    params = rank_params(MISTRAL, Layout(1, "hf"), 0)
    assert [p.name for p in params] == list(shapes) and all(len(p.pieces) == 1 for p in params)
    for layout in (Layout(2, "hf"), Layout(1, "fused")):
        with pytest.raises(ValueError, match="generic path"):
            layout.check(MISTRAL)


def test_reading_a_recipe_of_a_generic_model_imports_neither_torch_nor_transformers(tmp_path):
    import json
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps(MISTRAL.hf_config))
    code = (
        "import sys\n"
        "from services.kit.config.recipe import parse_recipe\n"
        f"r = parse_recipe('[model]\\npath = \"{tmp_path}\"\\n')\n"
        "assert r.model.architecture().generic\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
