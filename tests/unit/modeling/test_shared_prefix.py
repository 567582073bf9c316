"""A prompt shared by a group's samples is computed once, and the step's loss and gradient stay those
of the unshared batch."""

from __future__ import annotations

import pytest
import torch

from bench.shared_prompts import packed
from services.kit.config.recipe import AlgorithmSection
from services.modeling.config import ModelConfig
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.modeling.shared_prefix import share_prefixes
from services.trainer.step import StepSettings, micro_batch_loss

CONFIG = ModelConfig.tiny(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


# Two groups with different prompts (the second's differs from the first's only in its last token),
# samples of unequal lengths, and a sequence whose prompt nobody shares.
GROUPS = [
    ([5, 6, 7, 8, 9], [10, 11, 12]),
    ([5, 6, 7, 8, 9], [13]),
    ([1, 2, 3], [4, 4, 4, 4]),
    ([5, 6, 7, 8, 9], [14, 15, 16]),
    ([5, 6, 7, 8, 20], [10, 11, 12]),
    ([5, 6, 7, 8, 20], [21, 22]),
]


@pytest.mark.parametrize(
    "algorithm",
    [
        AlgorithmSection(loss_aggregation="token-mean", entropy_coef=0.01),
        AlgorithmSection(loss_aggregation="seq-mean-token-mean", kl_coef=0.05),
    ],
)
def test_shared_prompts_give_the_unshared_loss_and_gradient(algorithm: AlgorithmSection) -> None:
    mb = packed(GROUPS)
    model = Qwen2ForCausalLM(CONFIG, seed=0)
    ref = Qwen2ForCausalLM(CONFIG, seed=1) if algorithm.kl_coef else None
    results = []
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        settings = StepSettings(loss=algorithm, temperature=0.7, share_prompts=share)
        loss, metrics = micro_batch_loss(model, mb, settings, trainer_version=0, ref_model=ref)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((float(loss.detach()), metrics, grads))
    (plain_loss, plain_metrics, plain_grads), (shared_loss, shared_metrics, shared_grads) = results
    assert shared_loss == pytest.approx(plain_loss, rel=1e-5, abs=1e-7)
    assert shared_metrics == pytest.approx(plain_metrics, rel=1e-5, abs=1e-7)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert any(float(g.abs().sum()) > 0 for g in plain_grads.values())


def test_layout_lays_each_shared_prompt_out_once() -> None:
    mb = packed(GROUPS)
    prompts = [len(p) for p, _ in GROUPS]
    layout = share_prefixes(mb.input_ids, mb.position_ids, mb.cu_seqlens, prompts)
    assert layout is not None
    # Prompt [5..9] once + its 3 answers, [1, 2, 3] + its answer, prompt [5..8, 20] once + 2 answers.
    assert layout.cu_seqlens.tolist() == [0, 5 + 7, 12 + 7, 19 + 5 + 5]
    assert layout.num_tokens == mb.num_tokens - 2 * 5 - 5
    # Every original row maps to a compact row holding the same token at the same position.
    assert torch.equal(layout.input_ids[layout.row_of], mb.input_ids)
    assert torch.equal(layout.position_ids[layout.row_of], mb.position_ids)
    assert layout.segments.tolist()[:12] == [0] * 5 + [1, 1, 1, 2, 3, 3, 3]
    assert set(layout.segments.tolist()[12:19]) == {0}  # nobody shares [1, 2, 3]


def test_nothing_shared_gives_no_layout() -> None:
    mb = packed([([1, 2], [3]), ([1, 3], [3]), ([1, 2, 3], [3])])
    assert share_prefixes(mb.input_ids, mb.position_ids, mb.cu_seqlens, [2, 2, 3]) is None
    # Equal prompts but positions that do not start at 0 are not a shared prefix either.
    moved = mb.position_ids + 1
    assert share_prefixes(mb.input_ids, moved, mb.cu_seqlens, [2, 2, 2]) is None


def test_segments_must_match_the_batch() -> None:
    model = Qwen2ForCausalLM(CONFIG, seed=0)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="segments"):
        model(ids, torch.arange(3), torch.tensor([0, 3]), segments=torch.zeros(2, dtype=torch.long))


def test_a_long_group_is_split_with_the_prompt_in_each_part() -> None:
    mb = packed(GROUPS)
    prompts = [len(p) for p, _ in GROUPS]
    layout = share_prefixes(mb.input_ids, mb.position_ids, mb.cu_seqlens, prompts, max_compact_tokens=9)
    assert layout is not None
    # [5..9] + answers of 3 and 1 | [5..9] + 3 | [1, 2, 3] + 4 | [5..8, 20] + 3 | [5..8, 20] + 2
    assert layout.cu_seqlens.tolist() == [0, 9, 17, 24, 32, 39]
    model = Qwen2ForCausalLM(CONFIG, seed=0)
    with torch.no_grad():
        plain = model(mb.input_ids, mb.position_ids, mb.cu_seqlens)
        shared = model(layout.input_ids, layout.position_ids, layout.cu_seqlens, segments=layout.segments)
    torch.testing.assert_close(shared[layout.row_of], plain, rtol=1e-5, atol=1e-5)
