"""The single-process GRPO loop (bench/single_process_grpo.py) on the real engine, env, packer and loss.

What a user of the loop relies on: the sampler's log-probs are the trainer's log-probs (importance
ratio 1 on-policy, before and after a weight swap), one GRPO step moves probability towards the
completions that scored above their group's mean, and a short fixed-seed run raises the reward.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from bench.single_process_grpo import GRPOSettings, SingleProcessGRPO, run_sync


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    # The loop pins torch to one thread (deterministic sampling); other tests in this process must not inherit it.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _settings(**overrides) -> GRPOSettings:
    base = dict(
        steps=4,
        seed=3,
        rollouts_per_step=16,
        group_size=8,
        max_tokens=4,
        lr=1e-2,
        warmup_steps=0,
        env_config={"min_len": 2, "max_len": 2, "ops": ["rev"]},
    )
    base.update(overrides)
    return GRPOSettings(**base)


def _masked(values: list[torch.Tensor], micro) -> torch.Tensor:
    return torch.cat([v[mb.loss_mask > 0] for v, mb in zip(values, micro, strict=True)])


async def test_sampler_logprobs_equal_trainer_logprobs_before_and_after_a_weight_swap():
    loop = SingleProcessGRPO(_settings())
    await loop.start()
    try:
        for step in range(2):
            rollouts = await loop.rollouts(step)
            assert all(r.version == step for r in rollouts), "every token sampled under the served version"
            assert all(0 < len(r.completion_ids) <= 4 for r in rollouts)
            batch, rejected = loop.pack(step, rollouts)
            assert not rejected and batch is not None
            micro = loop.micro_batches(batch)
            trainer = _masked(loop.policy_logprobs(micro), micro)
            behaviour = _masked([mb.behaviour_logprobs for mb in micro], micro)
            assert trainer.numel() == sum(len(r.completion_ids) for r in rollouts)
            torch.testing.assert_close(trainer, behaviour, atol=1e-4, rtol=0)
            loop.train(batch)
            await loop.sync_weights()
            assert loop.engine.version == step + 1
    finally:
        await loop.close()


async def test_one_grpo_step_raises_the_logprob_of_above_average_completions():
    loop = SingleProcessGRPO(_settings(lr=3e-3))
    await loop.start()
    try:
        rollouts = await loop.rollouts(0)
    finally:
        await loop.close()
    # A random policy scores ~0 on the task, so the rewards here are data chosen to have a spread
    # in every group: a fixed, known ranking of each group's samples.
    for r in rollouts:
        r.reward = float(r.sample_index % 4)
    batch, _ = loop.pack(0, rollouts)
    micro = loop.micro_batches(batch)
    before = loop.policy_logprobs(micro)
    info = loop.train(batch)
    after = loop.policy_logprobs(micro)
    assert info["trained_tokens"] == sum(mb.num_tokens for mb in micro)
    gains, advantages = [], []
    for mb, b, a in zip(micro, before, after, strict=True):
        mask = mb.loss_mask > 0
        cu = mb.cu_seqlens.tolist()
        for s, e in itertools.pairwise(cu):
            m = mask[s:e]
            gains.append(float((a[s:e] - b[s:e])[m].sum()))
            advantages.append(float(mb.advantages[s:e][m][0]))
    gains, advantages = np.array(gains), np.array(advantages)
    assert (advantages > 0).any() and (advantages < 0).any()
    # The step increased the surrogate objective: sum_i A_i * delta log p_i > 0 ...
    assert float((advantages * gains).sum()) > 0
    # ... by making above-average completions likelier and below-average ones less likely.
    assert gains[advantages > 0].mean() > 0 > gains[advantages < 0].mean()


@pytest.mark.slow
def test_a_short_fixed_seed_run_raises_the_mean_reward():
    # The proposed default recipe (digits rev 2-3, 64 rollouts in groups of 8, lr 1e-2, max_tokens 4):
    # a random policy scores ~0.02; within ~20 steps it learns to answer with digits of the right
    # length (seeds 1-3 gain 0.035-0.07 by this measure; the assertion keeps a margin under that).
    settings = _settings(
        steps=24, seed=1, rollouts_per_step=64, warmup_steps=2, env_config={"min_len": 2, "max_len": 3}
    )
    records = run_sync(settings)
    rewards = [r.mean_reward for r in records]
    assert len(records) == 24 and all(r.trained_tokens > 0 for r in records)
    first, last = float(np.mean(rewards[:3])), float(np.mean(rewards[-5:]))
    assert first < 0.05, rewards
    assert last > first + 0.03, rewards


@pytest.mark.slow
def test_the_default_recipe_learns_the_reversal_not_only_the_answer_format():
    # An answer of the right length with digits the model does not condition on scores at most
    # 0.1 + 0.9 * 1/10 = 0.19 on average (the "format ceiling" where std-normalised GRPO stalls).
    # configs/digits_grpo.toml on the services' tasks and seeds gets past it by step ~175 for seed 1
    # (mean of steps 180-200: 0.24; 0.35 by 250).
    settings = GRPOSettings.from_recipe(steps=200, seed=1)
    assert settings.estimator == "dr_grpo" and settings.init_std == 0.1 and settings.entropy_coef == 0.0075
    rewards = [r.mean_reward for r in run_sync(settings)]
    first, last = float(np.mean(rewards[:3])), float(np.mean(rewards[-20:]))
    assert first < 0.05, rewards
    assert last > 0.22, rewards


def test_an_hf_format_recipe_samples_and_trains_with_its_own_tokenizer(tmp_path):
    from tools.build_hf_model import build

    model = tmp_path / "bpe"
    build(model, seed=0, vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8)
    recipe = tmp_path / "hf.toml"
    recipe.write_text(
        f'[run]\nname = "hf"\nsteps = 1\n[model]\npath = "{model}"\ntokenizer = "{model}"\n'
        '[environment]\nname = "digits"\n[batch]\nrollouts_per_step = 8\ngroup_size = 4\n'
        '[[deployments]]\nname = "cpu"\n'
    )
    settings = GRPOSettings.from_recipe(recipe)
    assert settings.tokenizer == str(model)
    loop = SingleProcessGRPO(settings)
    assert loop.tokenizer.vocab_size == loop.config.vocab_size == 512
    records = run_sync(settings)
    # The prompt is the BPE model's own chat template, decoded with its vocabulary.
    assert records[0].trained_tokens > 0 and records[0].sample.startswith("'<|im_start|>system")
