"""Reshard plans: every rank's pieces tile its tensors, cover the model, and follow vLLM's fused layout."""

from __future__ import annotations

import itertools

import pytest
import torch

from services.modeling.config import ModelConfig
from services.modeling.layouts import (
    Layout,
    Piece,
    apply_piece,
    hf_params,
    rank_params,
    shard_state_dict,
    unshard_state_dict,
)
from services.modeling.qwen2 import Qwen2ForCausalLM

TINY = ModelConfig.tiny()
CONFIGS = {
    "tiny": TINY,
    "untied_nobias_kv1": ModelConfig.tiny(
        tie_word_embeddings=False, attention_bias=False, model_type="llama", num_key_value_heads=1
    ),
    "mha8": ModelConfig.tiny(num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_hidden_layers=1),
    "qwen3_untied": ModelConfig.tiny_qwen3(tie_word_embeddings=False),
}
CASES = [(cfg_name, tp, naming) for cfg_name in CONFIGS for tp in (1, 2, 4) for naming in ("hf", "fused")]


def full_state_dict(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    # Distinct values everywhere, so a misplaced block cannot go unnoticed.
    out, offset = {}, 0
    for name, shape in hf_params(cfg).items():
        n = int(torch.tensor(shape).prod())
        out[name] = (torch.arange(offset, offset + n, dtype=torch.float64) / 1e6).reshape(shape).float()
        offset += n
    return out


@pytest.mark.parametrize(("cfg_name", "tp", "naming"), CASES)
def test_shards_reassemble_to_the_full_weights(cfg_name, tp, naming):
    cfg = CONFIGS[cfg_name]
    layout = Layout(tp_size=tp, naming=naming)
    full = full_state_dict(cfg)
    shards = [shard_state_dict(full, cfg, layout, r) for r in range(tp)]
    back = unshard_state_dict(shards, cfg, layout)
    assert back.keys() == full.keys()
    for name in full:
        assert torch.equal(back[name], full[name]), name


@pytest.mark.parametrize(("cfg_name", "tp", "naming"), CASES)
def test_pieces_tile_each_target_exactly_once_and_cover_every_source_element(cfg_name, tp, naming):
    cfg = CONFIGS[cfg_name]
    layout = Layout(tp_size=tp, naming=naming)
    shapes = hf_params(cfg)
    source_hits = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in shapes.items()}
    for rank in range(tp):
        params = rank_params(cfg, layout, rank)
        assert [p.name for p in params] == [p.name for p in rank_params(cfg, layout, rank)]  # deterministic
        assert len({p.name for p in params}) == len(params)
        for param in params:
            target_hits = torch.zeros(param.shape, dtype=torch.int32)
            for piece in param.pieces:
                target_hits[piece.target_index()] += 1
                source_hits[piece.source][piece.source_index()] += 1
            assert bool((target_hits == 1).all()), f"{param.name}: a target element is written 0 or 2+ times"
    for name, hits in source_hits.items():
        assert bool((hits >= 1).all()), f"{name}: some source element is sent to no rank"
    # total bytes across ranks: model once, plus replication (norms, kv heads when tp > kv); see below
    if tp == 1:
        assert all(bool((h == 1).all()) for h in source_hits.values())


def test_hf_naming_tp1_is_exactly_the_hf_state_dict_without_tied_lm_head():
    model = Qwen2ForCausalLM(TINY)
    hf_sd = model.hf_state_dict()
    params = rank_params(TINY, Layout(), 0)
    assert [p.name for p in params] == list(hf_sd.keys())
    assert all(p.shape == tuple(hf_sd[p.name].shape) for p in params)
    assert "lm_head.weight" not in {p.name for p in params}
    shard = shard_state_dict(model.state_dict(), TINY, Layout(), 0)
    assert all(torch.equal(shard[k], v) for k, v in hf_sd.items())


def test_fused_layout_matches_vllm_semantics_with_kv_replication():
    cfg, d = TINY, TINY.head_dim  # 4 q heads, 2 kv heads
    full = full_state_dict(cfg)
    p = "model.layers.1."
    q, k, v = (full[f"{p}self_attn.{n}_proj.weight"] for n in "qkv")
    heads = lambda w, hs: torch.cat([w[h * d : (h + 1) * d] for h in hs])  # noqa: E731

    tp2 = [shard_state_dict(full, cfg, Layout(2, "fused"), r) for r in range(2)]
    assert torch.equal(
        tp2[1][f"{p}self_attn.qkv_proj.weight"], torch.cat([heads(q, [2, 3]), heads(k, [1]), heads(v, [1])])
    )
    # tp=4 > 2 kv heads: ranks 0,1 share kv head 0; ranks 2,3 share kv head 1
    tp4 = [shard_state_dict(full, cfg, Layout(4, "fused"), r) for r in range(4)]
    for rank, kv_head in enumerate([0, 0, 1, 1]):
        expected = torch.cat([heads(q, [rank]), heads(k, [kv_head]), heads(v, [kv_head])])
        assert torch.equal(tp4[rank][f"{p}self_attn.qkv_proj.weight"], expected)
    qb, kb, vb = (full[f"{p}self_attn.{n}_proj.bias"] for n in "qkv")
    assert torch.equal(tp4[3][f"{p}self_attn.qkv_proj.bias"], torch.cat([qb[3 * d : 4 * d], kb[d:], vb[d:]]))

    gate, up, down = (full[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
    half = cfg.intermediate_size // 2
    assert torch.equal(tp2[1][f"{p}mlp.gate_up_proj.weight"], torch.cat([gate[half:], up[half:]]))
    assert torch.equal(tp2[1][f"{p}mlp.down_proj.weight"], down[:, half:])
    o = full[f"{p}self_attn.o_proj.weight"]
    assert torch.equal(tp2[0][f"{p}self_attn.o_proj.weight"], o[:, : 2 * d])
    # Vocab-parallel embeddings: 101 rows split 51 + 50 (ceil-div, the last rank holds fewer).
    embed = full["model.embed_tokens.weight"]
    assert torch.equal(tp2[0]["model.embed_tokens.weight"], embed[:51])
    assert torch.equal(tp2[1]["model.embed_tokens.weight"], embed[51:])
    assert torch.equal(tp4[3]["model.embed_tokens.weight"], embed[78:])  # 26 + 26 + 26 + 23
    assert torch.equal(tp2[1]["model.norm.weight"], full["model.norm.weight"])
    assert "lm_head.weight" not in tp2[0]


@pytest.mark.parametrize("naming", ["hf", "fused"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_ranks_together_hold_every_source_element_once_except_norms_and_replicated_kv_heads(naming, tp, tied):
    # A tp deployment receives the model once: only the RMSNorm weights (and kv heads when
    # tp > num_key_value_heads) go to every rank. Vocab 101 does not divide by 2 or 4.
    cfg = ModelConfig.tiny(vocab_size=101, tie_word_embeddings=tied)
    assert cfg.vocab_size % tp and cfg.num_key_value_heads == 2
    layout = Layout(tp, naming)
    shapes = hf_params(cfg)
    hits = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in shapes.items()}
    rows_per_rank = []
    for rank in range(tp):
        for param in rank_params(cfg, layout, rank):
            for piece in param.pieces:
                hits[piece.source][piece.source_index()] += 1
            if param.name == "model.embed_tokens.weight":
                rows_per_rank.append(param.shape[0])
    assert rows_per_rank == {2: [51, 50], 4: [26, 26, 26, 23]}[tp]
    kv_copies = max(1, tp // cfg.num_key_value_heads)
    for name, h in hits.items():
        if "norm" in name:
            expected = tp
        elif ".k_proj." in name or ".v_proj." in name:
            expected = kv_copies
        else:
            expected = 1
        assert bool((h == expected).all()), f"{name}: held {h.unique().tolist()} times, expected {expected}"
    assert ("lm_head.weight" in hits) == (not tied)

    # Bytes across ranks, by formula and by hand (fp32): the model once + (tp - 1) extra norm copies
    # + (kv_copies - 1) extra k/v copies.
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    model = sum(int(torch.tensor(s).prod()) for s in shapes.values())
    norms = (2 * layers + 1) * h
    kv = layers * 2 * (cfg.kv_size * h + cfg.kv_size)  # k and v weights + biases
    total = sum(p.numel for r in range(tp) for p in rank_params(cfg, layout, r))
    assert total == model + (tp - 1) * norms + (kv_copies - 1) * kv
    by_hand = {  # tiny: h=64=q_size (q, o), kv_size=32, i=128, V=101, 2 layers, q/k/v biases
        True: 101 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 64 + 2 * 32 + 3 * 64 * 128 + 2 * 64) + 64,
        False: 2 * 101 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 64 + 2 * 32 + 3 * 64 * 128 + 2 * 64) + 64,
    }[tied]
    assert model == by_hand
    assert total - model == {2: 5 * 64, 4: 3 * 5 * 64 + 2 * 2 * (32 * 64 + 32)}[tp]


def test_clipping_pieces_to_uneven_row_shards_reconstructs_each_target():
    # What weight-sync does with FSDP dim-0 shards: each trainer shard holds some rows of a source.
    cfg, layout = TINY, Layout(2, "fused")
    full = full_state_dict(cfg)
    for rank in range(2):
        expected = shard_state_dict(full, cfg, layout, rank)
        for param in rank_params(cfg, layout, rank):
            target = torch.full(param.shape, float("nan"))
            for piece in param.pieces:
                rows = full[piece.source].shape[0]
                bounds = [0, rows // 3 + 1, rows // 3 + 1, rows]  # uneven, with an empty shard
                for lo, hi in itertools.pairwise(bounds):
                    clipped = piece.clip_source_rows(lo, hi)
                    if clipped is not None:
                        apply_piece(target, clipped, full[piece.source])
            assert torch.equal(target, expected[param.name]), param.name


def test_layout_validation_names_the_problem():
    with pytest.raises(ValueError, match="num_attention_heads"):
        rank_params(TINY, Layout(tp_size=3), 0)
    with pytest.raises(ValueError, match="num_attention_heads"):
        Layout(tp_size=8).check(TINY)
    with pytest.raises(ValueError, match="intermediate_size"):
        Layout(tp_size=4).check(ModelConfig.tiny(intermediate_size=130))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Layout(tp_size=2).check(ModelConfig.tiny(num_attention_heads=6, num_key_value_heads=3))
    with pytest.raises(ValueError, match="vocabulary rows"):
        Layout(tp_size=4).check(ModelConfig.tiny(vocab_size=3))  # tp > vocab
    with pytest.raises(ValueError, match="vocabulary rows"):
        Layout(tp_size=4).check(ModelConfig.tiny(vocab_size=5))  # blocks of 2: rank 3 gets none
    Layout(tp_size=4).check(ModelConfig.tiny(vocab_size=7))  # 2 + 2 + 2 + 1
    with pytest.raises(ValueError, match="naming"):
        Layout(naming="megatron")
    with pytest.raises(ValueError, match="dtype"):
        Layout(dtype="fp8")
    with pytest.raises(ValueError, match="rank"):
        rank_params(TINY, Layout(tp_size=2), 2)
    with pytest.raises(ValueError, match="extents"):
        Piece("x", ((0, 2),), ((0, 3),))
    assert Layout.from_dict(Layout(2, "fused", "bfloat16").to_dict()) == Layout(2, "fused", "bfloat16")


def test_shard_state_dict_casts_to_layout_dtype_and_rejects_wrong_shapes():
    full = full_state_dict(TINY)
    shard = shard_state_dict(full, TINY, Layout(2, "fused", "bfloat16"), 0)
    assert all(t.dtype == torch.bfloat16 for t in shard.values())
    full["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        shard_state_dict(full, TINY, Layout(), 0)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("naming", ["hf", "fused"])
def test_a_lora_adapter_splits_as_its_base_layers_do_and_reassembles(tp, naming):
    from services.modeling.lora import TARGETS, LoraSpec

    adapter = TINY.with_lora(LoraSpec(4, 8.0, TARGETS))
    layout = Layout(tp_size=tp, naming=naming)
    full = full_state_dict(adapter)
    assert set(full) == {n for n in full if ".lora_A." in n or ".lora_B." in n}  # the adapter only
    shards = [shard_state_dict(full, adapter, layout, r) for r in range(tp)]
    back = unshard_state_dict(shards, adapter, layout)
    assert all(torch.equal(back[n], full[n]) for n in full)
    base = {p.name: p for p in rank_params(TINY, Layout(tp_size=tp, naming="hf"), 0)}
    mine = {p.name: p for p in rank_params(adapter, layout, 0)}
    for proj in ("q_proj", "k_proj", "gate_proj"):  # column-parallel: B has the base rank's output rows
        name = f"model.layers.0.{'mlp' if proj == 'gate_proj' else 'self_attn'}.{proj}"
        assert mine[f"{name}.lora_B.weight"].shape[0] == base[f"{name}.weight"].shape[0]
        assert mine[f"{name}.lora_A.weight"].shape == (4, TINY.hidden_size)
    for proj, side in (
        ("o_proj", "self_attn"),
        ("down_proj", "mlp"),
    ):  # row-parallel: A has its input columns
        name = f"model.layers.0.{side}.{proj}"
        assert mine[f"{name}.lora_A.weight"].shape[1] == base[f"{name}.weight"].shape[1]
        assert mine[f"{name}.lora_B.weight"].shape == (TINY.hidden_size, 4)
