"""Models users bring: a Qwen3 (fast path) and a Gemma (generic path: transformers' own code), each
built offline from its config by tools/build_hf_model.py, train a step on a real trainer rank, export
to a directory plain transformers loads, and the engine's log-probs of the trained policy equal the
trainer's and transformers' on the export within float tolerance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from trainer_steps import make_step

from services.inference_router.engine.base import EngineRequest, SamplingParams
from services.inference_router.engine.generic import GenericEngine
from services.kit.config.recipe import parse_recipe
from services.kit.local.infra import free_port
from services.modeling import causal_lm
from services.modeling.layouts import Layout
from services.modeling.logprobs import token_logprobs
from services.modeling.tokenizer import load_tokenizer
from services.modeling.tp_local import LocalTPGroup
from services.trainer.spec import TrainerSpec, spec_from_recipe
from services.trainer.worker import TrainerWorker
from tools.build_hf_model import build

pytestmark = pytest.mark.slow  # real trainer ranks train; transformers loads the exports

MESSAGES = [{"role": "user", "content": "What is 7 * 8?"}]
ANSWER = "7 * 8 = 56.\n#### 56"
SIZES = dict(hidden_size=64, intermediate_size=128, num_layers=2, head_dim=16, vocab_size=512)


@pytest.fixture(scope="module", params=["qwen3", "gemma"])
def built(request, tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp(request.param) / "model"
    build(out, seed=1, arch=request.param, init_std=0.1, **SIZES)
    return request.param, out


def _train_and_export(spec: TrainerSpec, out: Path) -> dict[str, torch.Tensor]:
    worker = TrainerWorker(rank=0, world_size=1, threads=1)
    worker.init_process_group("127.0.0.1", free_port(), timeout_s=60)
    try:
        worker.setup(spec)
        batches = make_step(step=0, world_size=1, micro_per_rank=1, seqs_per_micro=4, seed=11)[0][0]
        metrics = worker.train_step(batches)
        assert metrics["grad_norm"] > 0
        worker.export_hf(str(out))
        return worker.full_state_dict(rank0_only=True)
    finally:
        worker.shutdown()


def test_the_recipe_says_which_path_a_model_takes(built):
    arch, path = built
    recipe = parse_recipe(f'[model]\npath = "{path}"\ntokenizer = "{path}"\n')
    assert recipe.model.architecture().generic == (arch == "gemma")
    # the fast path refuses what it does not implement, naming the field; the generic path runs anything
    if arch == "gemma":
        with pytest.raises(ValueError, match=r"model\.implementation.*gemma"):
            parse_recipe(f'[model]\npath = "{path}"\nimplementation = "fast"\n')
        with pytest.raises(ValueError, match=r"deployments\[0\].*generic path"):
            parse_recipe(f'[model]\npath = "{path}"\n[[deployments]]\ntensor_parallel = 2\n')
    generic = parse_recipe(f'[model]\npath = "{path}"\nimplementation = "generic"\n')
    assert generic.model.architecture().generic


def test_a_brought_model_trains_exports_and_its_engine_logprobs_equal_trainer_and_transformers(
    built, tmp_path
):
    arch, path = built
    recipe = parse_recipe(
        f'[run]\nname = "byo-{arch}"\nsteps = 3\n[model]\npath = "{path}"\ntokenizer = "{path}"\n'
        "[optimizer]\nlr = 1e-3\n"
    )
    spec = spec_from_recipe(recipe, f"byo-{arch}")
    out = tmp_path / "export"
    trained = _train_and_export(spec, out)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and "looprl_implementation" not in config
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == {"qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM"}[arch]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(path)
    ids = torch.tensor(ours.apply_chat_template(MESSAGES) + ours.encode(ANSWER))
    assert (
        hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
        == ids[: len(ours.apply_chat_template(MESSAGES))].tolist()
    )
    cu = torch.tensor([0, len(ids)])
    with torch.no_grad():
        hf_logp = token_logprobs(hf_model(ids[None]).logits[0], ids, cu)
        trainer_model = causal_lm.load(path)
        trainer_model.load_hf_state_dict(trained)
        trainer_logp = token_logprobs(trainer_model.eval()(ids), ids, cu)
    torch.testing.assert_close(trainer_logp, hf_logp, atol=1e-4, rtol=0)
    exported = causal_lm.load(out)
    assert exported.config.generic == (arch == "gemma")
    assert not torch.equal(
        trained["model.norm.weight"], causal_lm.load(path).hf_state_dict()["model.norm.weight"]
    )

    if arch == "qwen3":  # the fast engine, unsharded and tensor-parallel
        for layout in (Layout(1, "hf"), Layout(2, "fused")):
            group = LocalTPGroup(exported.config, layout, max_slots=1, max_len=len(ids) + 1)
            group.load_full_state_dict(exported.hf_state_dict())
            engine_logp = token_logprobs(group.prefill(group.allocate(), ids, all_logits=True), ids, cu)
            group.close()
            torch.testing.assert_close(engine_logp, hf_logp, atol=1e-4, rtol=0)
        return

    # The generic engine samples, and the log-prob of every sampled token equals transformers' on it.
    import asyncio

    async def sample() -> list:
        engine = GenericEngine.create(exported.config, exported.hf_state_dict(), version=1, max_model_len=128)
        try:
            prompt = ours.apply_chat_template(MESSAGES)
            request = EngineRequest(prompt, SamplingParams(temperature=1.0, max_tokens=12, n=3, seed=5))
            [result] = await engine.generate([request])
            return [(prompt, c) for c in result.completions]
        finally:
            await engine.close()

    for prompt, completion in asyncio.run(sample()):
        assert completion.weight_version == 1 and completion.token_ids
        full = torch.tensor(prompt + completion.token_ids)
        with torch.no_grad():
            ref = token_logprobs(hf_model(full[None]).logits[0], full, torch.tensor([0, len(full)]))
        torch.testing.assert_close(torch.tensor(completion.logprobs), ref[len(prompt) :], atol=1e-4, rtol=0)
