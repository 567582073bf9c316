"""The engine model (sharded, KV-cached) computes the same logits as the packed training model."""

from __future__ import annotations

import pytest
import torch

from services.modeling.config import ModelConfig
from services.modeling.engine_model import EngineModel, KVCache
from services.modeling.layouts import Layout, shard_state_dict
from services.modeling.logprobs import sampled_logprobs, token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.modeling.tp_local import LocalTPGroup

CFG = ModelConfig.tiny()
LAYOUTS = [Layout(1, "fused"), Layout(2, "fused"), Layout(1, "hf"), Layout(2, "hf"), Layout(4, "fused")]


@pytest.fixture(scope="module")
def reference() -> Qwen2ForCausalLM:
    m = Qwen2ForCausalLM(CFG, seed=21).eval()
    m.init_weights(21, std=0.15)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return m


def group_for(reference, layout: Layout, max_slots: int = 4, max_len: int = 64) -> LocalTPGroup:
    group = LocalTPGroup(CFG, layout, max_slots, max_len)
    group.load_full_state_dict(reference.state_dict())
    return group


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.naming}-tp{lay.tp_size}")
def test_prefill_then_decode_equals_full_forward(reference, layout):
    seq = ids_of(20, 1)
    with torch.no_grad():
        expected = reference(seq)
    group = group_for(reference, layout)
    try:
        slot = group.allocate()
        prompt = 8
        all_prompt = group.prefill(slot, seq[:prompt], all_logits=True)
        torch.testing.assert_close(all_prompt, expected[:prompt], atol=1e-4, rtol=1e-4)
        for t in range(prompt, len(seq)):
            logits = group.decode(torch.tensor([slot]), seq[t : t + 1], torch.tensor([t]))
            torch.testing.assert_close(logits[0], expected[t], atol=1e-4, rtol=1e-4)
        assert group.caches[0].length(slot) == len(seq)
    finally:
        group.close()


@pytest.mark.parametrize("layout", [Layout(1, "fused"), Layout(2, "fused")], ids=["tp1", "tp2"])
def test_batched_decode_of_different_lengths_equals_each_alone(reference, layout):
    seqs = [ids_of(n, 10 + n) for n in (3, 11, 6)]
    group = group_for(reference, layout)
    try:
        slots = [group.allocate() for _ in seqs]
        prompt_lens = [len(s) - 2 for s in seqs]
        # batched prefill of all prompts (different lengths) in one pass
        firsts = group.run(
            lambda m, c: m.prefill_batch(
                c, slots, [s[:p] for s, p in zip(seqs, prompt_lens, strict=True)], [0, 0, 0]
            )
        )[0]
        batched = [torch.stack(firsts)]
        for step in range(2):
            pos = torch.tensor([p + step for p in prompt_lens])
            toks = torch.stack([s[p] for s, p in zip(seqs, pos.tolist(), strict=True)])
            batched.append(group.decode(torch.tensor(slots), toks, pos))
        with torch.no_grad():
            for b, s in enumerate(seqs):
                alone = reference(s)
                for step, logits in enumerate(batched):
                    torch.testing.assert_close(
                        logits[b], alone[prompt_lens[b] - 1 + step], atol=1e-4, rtol=1e-4
                    )
    finally:
        group.close()


@pytest.mark.parametrize("layout", [Layout(1, "fused"), Layout(2, "fused")], ids=["tp1", "tp2"])
def test_a_prompt_given_for_several_slots_is_prefilled_once_and_each_slot_decodes_exactly(reference, layout):
    """The n samples of a request share one prompt: its keys/values are computed once and copied,
    and every slot then continues on its own (different next tokens) exactly like a lone sequence."""
    a, b = ids_of(9, 31), ids_of(5, 32)
    conts = [ids_of(3, 40 + i) for i in range(4)]
    group = group_for(reference, layout, max_slots=6)
    try:
        slots = [group.allocate() for _ in range(4)]
        prompts = [a, b, a, a]
        firsts = group.run(lambda m, c: m.prefill_batch(c, slots, prompts, [0, 0, 0, 0]))[0]
        assert [group.caches[0].length(s) for s in slots] == [9, 5, 9, 9]
        steps = [torch.stack(firsts)]
        for t in range(3):
            pos = torch.tensor([len(p) + t for p in prompts])
            steps.append(group.decode(torch.tensor(slots), torch.stack([c[t] for c in conts]), pos))
        with torch.no_grad():
            for i, (prompt, cont) in enumerate(zip(prompts, conts, strict=True)):
                alone = reference(torch.cat([prompt, cont]))
                for t, logits in enumerate(steps):
                    torch.testing.assert_close(logits[i], alone[len(prompt) - 1 + t], atol=1e-4, rtol=1e-4)
        # The copies are independent: slot 0's continuation did not leak into slot 2's cache.
        assert not torch.equal(steps[-1][0], steps[-1][2])
    finally:
        group.close()


def test_decode_gives_the_same_logits_whether_its_slots_are_one_ascending_run_or_scattered(reference):
    """Slots in one ascending run have their keys read as a view, others gathered: bit for bit the same."""
    prompts = [ids_of(n, 60 + n) for n in (4, 7, 5)]
    tokens = torch.stack([ids_of(1, 70 + i)[0] for i in range(3)])
    positions = torch.tensor([len(p) for p in prompts])

    def decoded(slots: list[int]) -> torch.Tensor:
        model = EngineModel(CFG, Layout(1, "fused"))
        model.load_shard(shard_state_dict(reference.state_dict(), CFG, Layout(1, "fused"), 0))
        cache = model.new_cache(6, 32)
        model.prefill_batch(cache, slots, prompts, [0, 0, 0])
        return model.decode(cache, torch.tensor(slots), tokens, positions)

    torch.testing.assert_close(decoded([1, 2, 3]), decoded([4, 0, 2]), atol=0, rtol=0)


def test_multi_turn_append_and_rewind_reuse_the_cache(reference):
    seq = ids_of(24, 3)
    with torch.no_grad():
        expected = reference(seq)
    group = group_for(reference, Layout(2, "fused"))
    try:
        slot = group.allocate()
        group.prefill(slot, seq[:10])
        # second turn appended at the cached length
        torch.testing.assert_close(
            group.prefill(slot, seq[10:18], start_pos=10), expected[17], atol=1e-4, rtol=1e-4
        )
        # rewind: replace the tail after position 14 with the true continuation again
        torch.testing.assert_close(
            group.prefill(slot, seq[14:24], start_pos=14), expected[23], atol=1e-4, rtol=1e-4
        )
        assert group.caches[1].length(slot) == 24
        group.free(slot)
        assert group.allocate() == slot
        assert group.caches[0].length(slot) == 0
    finally:
        group.close()


def test_engine_logprobs_match_trainer_logprobs(reference):
    # What issue 3/7 need: sampler-side log-probs (engine logits) == trainer-side token_logprobs.
    seq = ids_of(16, 5)
    with torch.no_grad():
        trainer = token_logprobs(reference(seq), seq, torch.tensor([0, 16]), temperature=0.8)
    group = group_for(reference, Layout(2, "fused"))
    try:
        slot = group.allocate()
        logits = [group.prefill(slot, seq[:6])]
        for t in range(6, 15):
            logits.append(group.decode(torch.tensor([slot]), seq[t : t + 1], torch.tensor([t]))[0])
        engine = sampled_logprobs(torch.stack(logits), seq[6:], 0.8)
        torch.testing.assert_close(engine, trainer[6:], atol=1e-4, rtol=1e-4)
    finally:
        group.close()


def test_load_shard_is_strict_and_atomic(reference):
    layout = Layout(2, "fused")
    model = EngineModel(CFG, layout, rank=1, all_reduce=lambda t: None)
    good = shard_state_dict(reference.state_dict(), CFG, layout, 1)
    model.load_shard(good)
    assert model.params["lm_head.weight"] is model.params["model.embed_tokens.weight"]
    before = dict(model.params)

    wrong_shape = dict(good)
    wrong_shape["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(3, CFG.hidden_size)
    with pytest.raises(ValueError, match=r"qkv_proj\.weight has shape"):
        model.load_shard(wrong_shape)
    wrong_dtype = dict(good)
    wrong_dtype["model.norm.weight"] = good["model.norm.weight"].double()
    with pytest.raises(ValueError, match="dtype"):
        model.load_shard(wrong_dtype)
    hf_names = shard_state_dict(reference.state_dict(), CFG, Layout(2, "hf"), 1)
    with pytest.raises(ValueError, match="missing"):
        model.load_shard(hf_names)
    assert all(model.params[k] is v for k, v in before.items())  # old weights still serving

    with pytest.raises(ValueError, match="all_reduce"):
        EngineModel(CFG, layout, rank=0)


def test_bad_requests_are_rejected_with_clear_errors(reference):
    model = EngineModel(CFG, Layout())
    cache = KVCache(CFG, Layout(), max_slots=2, max_len=8)
    with pytest.raises(RuntimeError, match="no weights"):
        model.prefill(cache, 0, ids_of(3, 0))
    model.load_shard(shard_state_dict(reference.state_dict(), CFG, Layout(), 0))
    with pytest.raises(ValueError, match="max_len"):
        model.prefill(cache, 0, ids_of(9, 0))
    with pytest.raises(ValueError, match="token ids"):
        model.prefill(cache, 0, torch.tensor([CFG.vocab_size]))
    with pytest.raises(ValueError, match="start_pos"):
        model.prefill(cache, 0, ids_of(2, 0), start_pos=3)
    model.prefill(cache, 0, ids_of(3, 0))
    with pytest.raises(ValueError, match="positions"):
        model.decode(cache, torch.tensor([0]), torch.tensor([1]), torch.tensor([5]))
    with pytest.raises(ValueError, match="duplicate"):
        model.decode(cache, torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([3, 3]))
    a, b = cache.allocate(), cache.allocate()
    assert (a, b) == (0, 1)
    with pytest.raises(RuntimeError, match="slots"):
        cache.allocate()
    cache.free(b)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free(b)


def test_bfloat16_layout_runs_close_to_fp32(reference):
    group = group_for(reference, Layout(2, "fused", "bfloat16"))
    try:
        seq = ids_of(12, 8)
        slot = group.allocate()
        logits = group.prefill(slot, seq, all_logits=True)
        assert logits.dtype == torch.float32
        with torch.no_grad():
            torch.testing.assert_close(logits, reference(seq), atol=0.1, rtol=0.05)
    finally:
        group.close()


def test_a_failing_rank_does_not_hang_the_group(reference):
    group = group_for(reference, Layout(2, "fused"))
    try:
        slot = group.allocate()

        def fail_on_rank1(model, cache):
            if model.rank == 1:
                raise RuntimeError("rank 1 broke")
            return model.prefill(cache, slot, ids_of(4, 0))

        with pytest.raises(RuntimeError, match="rank 1 broke"):
            group.run(fail_on_rank1)
        # the group still works afterwards
        assert group.prefill(slot, ids_of(4, 0)).shape == (CFG.vocab_size,)
    finally:
        group.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_and_packed_model_agree_on_gpu(reference):
    model = Qwen2ForCausalLM(CFG, seed=None).cuda().eval()
    model.load_hf_state_dict({k: v.cuda() for k, v in reference.state_dict().items()})
    seqs = [ids_of(n, n).cuda() for n in (7, 3, 12)]
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(len(s), device="cuda") for s in seqs])
    cu = torch.tensor([0, 7, 10, 22], device="cuda")
    with torch.no_grad():
        packed = model(ids, pos, cu)
    lp = token_logprobs(packed, ids, cu)
    assert lp.device.type == "cuda"
    group = LocalTPGroup(CFG, Layout(2, "fused"), max_slots=4, max_len=32, device="cuda")
    try:
        group.load_full_state_dict(reference.state_dict())
        slots = [group.allocate() for _ in seqs]
        for slot, s, start in zip(slots, seqs, (0, 7, 10), strict=True):
            logits = group.prefill(slot, s[:-1], all_logits=True)
            torch.testing.assert_close(logits, packed[start : start + len(s) - 1], atol=1e-4, rtol=1e-4)
        last = torch.stack([s[-1] for s in seqs])
        positions = torch.tensor([len(s) - 1 for s in seqs])
        out = group.decode(torch.tensor(slots), last, positions)
        torch.testing.assert_close(out, packed[cu[1:] - 1], atol=1e-4, rtol=1e-4)
    finally:
        group.close()


@pytest.mark.parametrize("gather", [True, False], ids=["all_gather", "all_reduce_fallback"])
@pytest.mark.parametrize(
    "layout", [Layout(2, "hf"), Layout(4, "fused")], ids=lambda lay: f"{lay.naming}-tp{lay.tp_size}"
)
def test_vocab_parallel_embeddings_and_untied_lm_head_give_every_rank_the_full_logits(layout, gather):
    # Each rank holds only its vocabulary rows (101 over 2 or 4 ranks: uneven) of embed_tokens and of
    # an untied lm_head; every rank must still see the reference's full logits for any token.
    cfg = ModelConfig.tiny(tie_word_embeddings=False)
    ref = Qwen2ForCausalLM(cfg, seed=5).eval()
    ref.init_weights(5, std=0.15)
    group = LocalTPGroup(cfg, layout, max_slots=2, max_len=32)
    try:
        group.load_full_state_dict(ref.state_dict())
        rows = [m.params["lm_head.weight"].shape[0] for m in group.models]
        assert rows == {2: [51, 50], 4: [26, 26, 26, 23]}[layout.tp_size]
        assert [m.params["model.embed_tokens.weight"].shape[0] for m in group.models] == rows
        if not gather:
            for m in group.models:
                m.all_gather = None
        # the first and last token ids sit on the first and last rank
        seq = torch.cat([torch.tensor([0, cfg.vocab_size - 1]), ids_of(10, 9)])
        with torch.no_grad():
            expected = ref(seq)
        slot = group.allocate()
        per_rank = group.run(lambda m, c: m.prefill(c, slot, seq[:-1], all_logits=True))
        per_rank_step = group.run(
            lambda m, c: m.decode(c, torch.tensor([slot]), seq[-1:], torch.tensor([len(seq) - 1]))
        )
        for logits, step in zip(per_rank, per_rank_step, strict=True):
            assert logits.shape == (len(seq) - 1, cfg.vocab_size) and logits.is_contiguous()
            torch.testing.assert_close(logits, expected[:-1], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(step[0], expected[-1], atol=1e-4, rtol=1e-4)
    finally:
        group.close()


@pytest.mark.parametrize("layout", [Layout(1, "hf"), Layout(2, "fused")], ids=["hf-tp1", "fused-tp2"])
def test_qwen3_engine_prefill_and_decode_equal_the_packed_model(layout):
    # Qwen3's per-head q/k norms are replicated on every rank and applied before RoPE.
    cfg = ModelConfig.tiny_qwen3(tie_word_embeddings=False)
    ref = Qwen2ForCausalLM(cfg, seed=8).eval()
    ref.init_weights(8, std=0.15)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
    seq = ids_of(14, 3)
    with torch.no_grad():
        expected = ref(seq)
    group = LocalTPGroup(cfg, layout, max_slots=2, max_len=32)
    try:
        group.load_full_state_dict(ref.state_dict())
        slot = group.allocate()
        torch.testing.assert_close(
            group.prefill(slot, seq[:9], all_logits=True), expected[:9], atol=1e-4, rtol=1e-4
        )
        for t in range(9, len(seq)):
            step = group.decode(torch.tensor([slot]), seq[t : t + 1], torch.tensor([t]))
            torch.testing.assert_close(step[0], expected[t], atol=1e-4, rtol=1e-4)
    finally:
        group.close()
