"""The trainer's Hugging Face export is complete: plain transformers loads it (model and tokenizer),
`generate()` stops where the policy emits eos, and its next-token log-probs equal the trainer's own
and the inference engine's within 1e-4 (fp32). Runs one real trainer rank in this process (gloo,
world size 1) for the char tokenizer and for the BPE model of tools/build_hf_model.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers
from trainer_steps import make_step

from services.kit.config.recipe import parse_recipe
from services.kit.local.infra import free_port
from services.modeling.layouts import Layout
from services.modeling.logprobs import token_logprobs
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.modeling.tokenizer import CharTokenizer, load_tokenizer
from services.modeling.tp_local import LocalTPGroup
from services.trainer.spec import TrainerSpec
from services.trainer.worker import TrainerWorker
from tools.build_hf_model import build

pytestmark = pytest.mark.slow  # a real trainer rank trains a step; transformers generates

MESSAGES = [
    {"role": "user", "content": "Ann has 12 apples, buys 30 more, then gives away 4. How many are left?"}
]
MAX_NEW = 40


@torch.no_grad()
def rig_toward_eos(model: Qwen2ForCausalLM, eos: int) -> None:
    """Make eos likely at every position while the other tokens keep their own logits: residual
    dimension 0 holds a constant no layer writes to, and eos's (tied) output row reads it more
    strongly than the other rows do: by ~ln(vocab) nats after the final norm (which scales that
    dimension to ~sqrt(hidden)), so eos has a probability of roughly 1/3 at every step."""
    config = model.config
    strength = 1.0 + (math.log(config.vocab_size) - 0.5) / math.sqrt(config.hidden_size)
    embed = model.model.embed_tokens.weight
    embed[:, 0] = 1.0
    embed[eos, 0] = strength
    if not model.config.tie_word_embeddings:
        model.lm_head.weight[:, 0] = embed[:, 0]
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight[0, :] = 0.0
        layer.mlp.down_proj.weight[0, :] = 0.0


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bpe") / "tiny-bpe"
    build(out, seed=0, hidden_size=64, intermediate_size=128, num_layers=2, head_dim=16)
    return out


def _start_model(kind: str, tmp_path: Path, bpe_model: Path) -> tuple[Path, str]:
    """A rigged starting checkpoint and the run's tokenizer spec."""
    if kind == "char":
        from services.modeling.config import ModelConfig

        model = Qwen2ForCausalLM(ModelConfig.tiny(), seed=7)
        tokenizer = "char"
        eos = CharTokenizer().eos_token_id
    else:
        model = Qwen2ForCausalLM.from_pretrained(bpe_model)
        tokenizer = str(bpe_model)
        eos = load_tokenizer(bpe_model).eos_token_id
    rig_toward_eos(model, eos)
    start = tmp_path / "start"
    model.save_pretrained(start)
    return start, tokenizer


def _train_and_export(spec: TrainerSpec, out: Path) -> dict[str, torch.Tensor]:
    """One trainer step on a real rank, then the export; returns the trained full state dict."""
    worker = TrainerWorker(rank=0, world_size=1, threads=1)
    worker.init_process_group("127.0.0.1", free_port(), timeout_s=60)
    try:
        worker.setup(spec)
        batches = make_step(step=0, world_size=1, micro_per_rank=1, seqs_per_micro=4, seed=11)[0][0]
        worker.train_step(batches)
        worker.export_hf(str(out))
        return worker.full_state_dict(rank0_only=True)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_export_loads_in_transformers_stops_at_eos_and_matches_engine_logprobs(kind, tmp_path, bpe_model):
    start, tokenizer = _start_model(kind, tmp_path, bpe_model)
    recipe = parse_recipe(
        f'[run]\nname = "export-{kind}"\nsteps = 3\n[model]\npath = "{start}"\ntokenizer = "{tokenizer}"\n'
        "[optimizer]\nlr = 1e-3\n"
    )
    spec = TrainerSpec(recipe=recipe, run_id=f"export-{kind}")
    out = tmp_path / "export"
    trained = _train_and_export(spec, out)
    # Written aside and renamed whole (a reader never finds half an export): nothing is left of, or
    # names, the directory it was written in.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("export")) == ["export"]
    texts = [f.read_text() for f in out.iterdir() if f.suffix in (".json", ".md")]
    assert texts and not any(".partial" in t for t in texts)

    # A model card naming the run, the step and the recipe.
    card = (out / "README.md").read_text()
    assert f"export-{kind}" in card and "| step | 1 |" in card and '"group_size": 8' in card

    ours = load_tokenizer(tokenizer)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert hf_tok.eos_token_id == ours.eos_token_id and hf_tok.pad_token_id == ours.pad_token_id
    assert hf_model.generation_config.pad_token_id == ours.pad_token_id
    prompt = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt")
    assert prompt["input_ids"][0].tolist() == ours.apply_chat_template(MESSAGES)
    prompt_len = prompt["input_ids"].shape[1]

    # generate() stops where the policy stops: at eos, after a few tokens, well before the limit ...
    lengths = []
    for seed in range(5):
        torch.manual_seed(seed)
        completion = hf_model.generate(**prompt, max_new_tokens=MAX_NEW, do_sample=True)[0, prompt_len:]
        assert int(completion[-1]) == ours.eos_token_id and len(completion) < MAX_NEW
        lengths.append(len(completion))
    assert max(lengths) > 1, f"every sample stopped at once: {lengths}"
    # ... and only because of the ids the export writes: the same weights saved without them run on.
    weights_only = tmp_path / "weights-only"
    Qwen2ForCausalLM.from_pretrained(out).save_pretrained(weights_only)
    bare = transformers.AutoModelForCausalLM.from_pretrained(weights_only, dtype=torch.float32)
    torch.manual_seed(0)
    runs_on = bare.generate(**prompt, max_new_tokens=MAX_NEW, do_sample=True)
    assert runs_on.shape[1] - prompt_len == MAX_NEW

    # Next-token log-probs of the trained policy: transformers on the export == the trainer's model ==
    # the inference engine (tp 1 and tp 2) on the exported weights.
    ids = torch.tensor(
        ours.apply_chat_template(MESSAGES) + ours.encode("12 + 30 = 42. 42 - 4 = 38.\n#### 38")
    )
    cu = torch.tensor([0, len(ids)])
    with torch.no_grad():
        hf_logp = token_logprobs(hf_model(ids[None]).logits[0], ids, cu)
        trainer_model = Qwen2ForCausalLM(Qwen2ForCausalLM.from_pretrained(start).config, seed=None)
        trainer_model.load_hf_state_dict(trained)
        trainer_logp = token_logprobs(trainer_model(ids), ids, cu)
    exported = Qwen2ForCausalLM.from_pretrained(out)
    for layout in (Layout(1, "fused"), Layout(2, "fused")):
        group = LocalTPGroup(exported.config, layout, max_slots=1, max_len=len(ids) + 1)
        group.load_full_state_dict(exported.hf_state_dict())
        engine_logp = token_logprobs(group.prefill(group.allocate(), ids, all_logits=True), ids, cu)
        torch.testing.assert_close(engine_logp, hf_logp, atol=1e-4, rtol=0)
    torch.testing.assert_close(trainer_logp, hf_logp, atol=1e-4, rtol=0)
    assert not torch.equal(
        trained["model.norm.weight"], Qwen2ForCausalLM.from_pretrained(start).model.norm.weight
    )
