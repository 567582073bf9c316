"""Sampler and request validation: the log-prob convention and per-request reproducibility."""

from __future__ import annotations

import pytest
import torch

from services.inference_router.engine.base import EngineRequest, SamplingParams, validate_request
from services.inference_router.engine.sampling import SamplerRow, make_generator, sample
from services.kit.rpc.errors import InvalidArgument


def test_logprob_is_under_tempered_distribution_before_truncation() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    rows = [
        SamplerRow(0.7, 5, 1.0, make_generator(1)),
        SamplerRow(1.3, 0, 0.5, make_generator(2)),
        SamplerRow(0.0, 0, 1.0, None),
    ]
    tokens, logprobs = sample(logits, rows)
    for i, (row, tok, lp) in enumerate(zip(rows, tokens, logprobs, strict=True)):
        temperature = row.temperature or 1.0
        expected = torch.log_softmax(logits[i] / temperature, dim=-1)[tok]
        assert lp == pytest.approx(float(expected), abs=1e-6)
    assert tokens[2] == int(logits[2].argmax())


def test_top_k_and_top_p_restrict_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    seen_k, seen_p = set(), set()
    gen_k, gen_p = make_generator(7), make_generator(8)
    for _ in range(200):
        seen_k.add(sample(logits, [SamplerRow(5.0, 2, 1.0, gen_k)])[0][0])
        seen_p.add(sample(logits, [SamplerRow(1.0, 0, 0.7, gen_p)])[0][0])
    assert seen_k == {0, 1}
    # p(0) ~ 0.64 < 0.7, so the nucleus is {0, 1}.
    assert seen_p == {0, 1}


def test_seeded_rows_do_not_depend_on_batch_neighbours() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    alone = [sample(logits[:1], [SamplerRow(1.0, 0, 1.0, g)])[0][0] for g in [make_generator(42)]]
    rows = [SamplerRow(1.0, 0, 1.0, make_generator(42)), SamplerRow(1.0, 0, 1.0, make_generator(3))]
    assert sample(logits[:2], rows)[0][0] == alone[0]


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(), "prompt_token_ids"),
        ([1, 200], SamplingParams(), "prompt_token_ids"),
        ([-1], SamplingParams(), "prompt_token_ids"),
        ([1], SamplingParams(temperature=-0.5), "sampling.temperature"),
        ([1], SamplingParams(max_tokens=0), "sampling.max_tokens"),
        ([1, 2, 3], SamplingParams(max_tokens=62), "sampling.max_tokens"),
        ([1], SamplingParams(top_p=1.5), "sampling.top_p"),
        ([1], SamplingParams(top_k=-1), "sampling.top_k"),
        ([1], SamplingParams(n=0), "sampling.n"),
        ([1], SamplingParams(stop_token_ids=(100,)), "sampling.stop_token_ids"),
    ],
)
def test_bad_requests_name_the_field(prompt: list[int], params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_request(EngineRequest(prompt, params), vocab_size=100, max_model_len=64)
    assert str(err.value).startswith(field + ":")


def test_valid_request_passes_and_proto_defaults_map() -> None:
    from looprl.common.v1 import common_pb2

    params = SamplingParams.from_proto(common_pb2.SamplingParams(max_tokens=4))
    assert params.top_p == 1.0 and params.n == 1 and params.seed is None and params.greedy
    validate_request(EngineRequest([1, 2, 3], params), vocab_size=100, max_model_len=64)


def test_sampled_tokens_follow_the_tempered_distribution() -> None:
    torch.manual_seed(2)
    vocab, draws, temperature = 12, 6000, 0.8
    logits = torch.randn(1, vocab).repeat(draws, 1)
    rows = [SamplerRow(temperature, 0, 1.0, make_generator(1000 + i)) for i in range(draws)]
    tokens, _ = sample(logits, rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    expected = torch.softmax(logits[0] / temperature, dim=-1).double() * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    # 11 degrees of freedom: P(chi-square > 31.3) = 0.001. A sampler off by one token, or one that
    # ignores the temperature, scores in the hundreds.
    assert chi_square < 31.3, (counts.tolist(), expected.tolist())


def test_truncated_tokens_are_never_drawn_even_at_the_edges_of_the_vocabulary() -> None:
    logits = torch.tensor([[-1.0, 5.0, 4.9, -2.0]]).repeat(500, 1)
    rows = [SamplerRow(1.0, 2, 1.0, make_generator(i)) for i in range(500)]
    assert set(sample(logits, rows)[0]) == {1, 2}


def test_logits_holding_nan_draw_no_token() -> None:
    logits = torch.tensor([[0.5, float("nan"), 0.1]])
    with pytest.raises(RuntimeError, match="NaN or inf"):
        sample(logits, [SamplerRow(1.0, 0, 1.0, make_generator(0))])
