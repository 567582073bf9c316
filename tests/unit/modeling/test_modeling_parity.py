"""Our Qwen2 equals transformers' Qwen2 exactly: logits, packed batches, checkpoints, log-probs."""

from __future__ import annotations

import pytest
import torch
import transformers

from services.modeling.config import ModelConfig
from services.modeling.logprobs import entropy, sampled_logprobs, token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM

CFG = ModelConfig.tiny()


def hf_model(cfg: ModelConfig, sd: dict[str, torch.Tensor], impl: str = "eager"):
    hf_cfg = transformers.Qwen2Config(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = impl
    model = transformers.Qwen2ForCausalLM(hf_cfg).float().eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0]


def pack(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
    return ids, pos, cu


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    # Larger init than the default so activations are not tiny and differences would show.
    m = Qwen2ForCausalLM(CFG, seed=3).eval()
    m.init_weights(3, std=0.2)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return m


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_logits_equal_transformers(model, impl):
    ids = torch.randint(0, CFG.vocab_size, (23,), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(hf_model(CFG, model.state_dict(), impl), ids)
    with torch.no_grad():
        ours = model(ids)
    assert ours.shape == (23, CFG.vocab_size)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_untied_and_mha_configs_equal_transformers():
    cfg = ModelConfig.tiny(tie_word_embeddings=False, num_key_value_heads=4, num_hidden_layers=1)
    m = Qwen2ForCausalLM(cfg, seed=5).eval()
    assert m.lm_head.weight is not m.model.embed_tokens.weight
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            m(ids), hf_logits(hf_model(cfg, m.state_dict()), ids), atol=1e-5, rtol=1e-5
        )


def test_packed_forward_equals_each_sequence_alone(model):
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in (5, 17, 1, 9)]
    ids, pos, cu = pack(seqs)
    hf = hf_model(CFG, model.state_dict())
    with torch.no_grad():
        packed = model(ids, pos, cu)
        for i, s in enumerate(seqs):
            rows = packed[cu[i] : cu[i + 1]]
            torch.testing.assert_close(rows, model(s), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(rows, hf_logits(hf, s), atol=1e-5, rtol=1e-5)


def test_save_pretrained_loads_in_transformers_and_back(model, tmp_path):
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, CFG.vocab_size, (13,), generator=torch.Generator().manual_seed(2))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).float().eval()
    with torch.no_grad():
        expected = model(ids)
        torch.testing.assert_close(hf_logits(hf, ids), expected, atol=1e-5, rtol=1e-5)
        back = Qwen2ForCausalLM.from_pretrained(tmp_path).eval()
        assert back.lm_head.weight is back.model.embed_tokens.weight
        torch.testing.assert_close(back(ids), expected, atol=0, rtol=0)
    # and a checkpoint written by transformers loads here
    hf.save_pretrained(tmp_path / "from_hf")
    again = Qwen2ForCausalLM.from_pretrained(tmp_path / "from_hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids), expected, atol=1e-6, rtol=1e-6)


def test_from_pretrained_rejects_wrong_names(model, tmp_path):
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "model.safetensors"))
    sd["model.layers.0.self_attn.qkv_proj.weight"] = sd.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="q_proj"):
        Qwen2ForCausalLM.from_pretrained(tmp_path)


def test_init_is_deterministic_and_independent_of_global_rng():
    torch.manual_seed(1)
    a = Qwen2ForCausalLM(CFG, seed=11).state_dict()
    torch.manual_seed(2)
    b = Qwen2ForCausalLM(CFG, seed=11).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = Qwen2ForCausalLM(CFG, seed=12).state_dict()
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_packed_inputs_are_validated(model):
    ids = torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids, torch.arange(5), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, torch.arange(4), torch.tensor([0, 5]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy_match_a_direct_computation(model, temperature):
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in (6, 1, 10)]
    ids, pos, cu = pack(seqs)
    with torch.no_grad():
        logits = model(ids, pos, cu)
    lp = token_logprobs(logits, ids, cu, temperature)
    ent = entropy(logits, cu, temperature)
    for i, s in enumerate(seqs):
        alone = torch.log_softmax(model(s).detach().double() / temperature, -1)
        expected = torch.zeros(len(s), dtype=torch.float64)
        expected_ent = torch.zeros(len(s), dtype=torch.float64)
        for t in range(1, len(s)):
            expected[t] = alone[t - 1, s[t]]
            expected_ent[t] = -(alone[t - 1].exp() * alone[t - 1]).sum()
        torch.testing.assert_close(lp[cu[i] : cu[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent[cu[i] : cu[i + 1]].double(), expected_ent, atol=1e-5, rtol=1e-5)
    # sequence starts are exactly 0
    assert lp[cu[:-1]].abs().sum() == 0


def test_token_logprobs_are_differentiable_and_sampled_logprobs_agree(model):
    ids = torch.randint(0, CFG.vocab_size, (8,), generator=torch.Generator().manual_seed(9))
    logits = model(ids)
    lp = token_logprobs(logits, ids, torch.tensor([0, 8]), 0.5)
    lp.sum().backward()
    assert model.model.embed_tokens.weight.grad is not None
    # what a sampler reports for the token it sampled equals the trainer's view
    per_row = sampled_logprobs(logits.detach()[:-1], ids[1:], torch.full((7,), 0.5))
    torch.testing.assert_close(per_row, lp.detach()[1:])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, ids, torch.tensor([0, 8]), 0.0)


def _qwen3(seed: int = 9) -> tuple[ModelConfig, Qwen2ForCausalLM]:
    cfg = ModelConfig.tiny_qwen3(tie_word_embeddings=False)
    m = Qwen2ForCausalLM(cfg, seed=seed).eval()
    m.init_weights(seed, std=0.2)
    with torch.no_grad():  # non-trivial q/k norms, so a missing or misplaced norm would show
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
    return cfg, m


def test_qwen3_logits_and_packed_batches_equal_transformers_qwen3():
    cfg, m = _qwen3()
    assert "model.layers.0.self_attn.q_norm.weight" in m.state_dict()
    assert "model.layers.0.self_attn.q_proj.bias" not in m.state_dict()
    hf_cfg = transformers.Qwen3Config(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = "eager"
    hf = transformers.Qwen3ForCausalLM(hf_cfg).float().eval()
    missing, unexpected = hf.load_state_dict(m.state_dict(), strict=False)
    assert not missing and not unexpected
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (7, 15, 2)]
    ids, pos, cu = pack(seqs)
    with torch.no_grad():
        packed = m(ids, pos, cu)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(packed[cu[i] : cu[i + 1]], hf_logits(hf, s), atol=1e-5, rtol=1e-5)


def test_qwen3_exports_to_a_directory_transformers_loads_as_qwen3(tmp_path):
    cfg, m = _qwen3(seed=4)
    m.save_pretrained(tmp_path)
    assert ModelConfig.from_hf_dict(transformers.AutoConfig.from_pretrained(tmp_path).to_dict()) == cfg
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).float().eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(hf, ids), m(ids), atol=1e-5, rtol=1e-5)
        back = Qwen2ForCausalLM.from_pretrained(tmp_path).eval()
        torch.testing.assert_close(back(ids), m(ids), atol=0, rtol=0)


def test_qwen_families_refuse_inconsistent_configs():
    with pytest.raises(ValueError, match="qk_norm"):
        ModelConfig.tiny(qk_norm=True)  # a Qwen2 with q/k norms is no checkpoint transformers loads
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.tiny(attention_bias=False)  # Qwen2 always has q/k/v biases
    sliding = {**ModelConfig.tiny_qwen3().to_hf_dict(), "layer_types": ["sliding_attention"] * 2}
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict(sliding, "fast")
    assert ModelConfig.from_hf_dict(sliding).generic  # auto: transformers' code runs it
    assert ModelConfig.from_hf_dict(
        {**ModelConfig.tiny_qwen3().to_hf_dict(), "attention_bias": True}
    ).attention_bias
