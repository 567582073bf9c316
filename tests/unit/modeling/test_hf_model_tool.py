"""tools/build_hf_model.py and the HF-directory tokenizer: plain transformers loads what the tool writes,
looprl's tokenizer gives transformers' chat-template ids, and the char tokenizer written as HF files
gives CharTokenizer's ids."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers

from services.environment_sandbox.environments.datasets import task_by_index
from services.kit.config.recipe import load_recipe
from services.modeling.config import ModelConfig
from services.modeling.hf_files import write_char_tokenizer
from services.modeling.hf_tokenizer import HFTokenizer
from services.modeling.qwen2 import Qwen2ForCausalLM
from services.modeling.tokenizer import CharTokenizer, load_tokenizer
from services.trainer.spec import spec_from_recipe
from tools.build_hf_model import build, main
from tools.hf_warm_start import environment_examples

CONVERSATIONS = [
    [{"role": "user", "content": "Ann has 12 apples, buys 30 more, then gives away 4. How many are left?"}],
    [
        {"role": "system", "content": "You answer with a number."},
        {"role": "user", "content": "What is 7 * 8?"},
        {"role": "assistant", "content": "7 * 8 = 56.\n#### 56"},
        {"role": "user", "content": "And 56 / 7?  Tabs\tand  spaces, café, 東京 ✓"},
    ],
    [{"role": "user", "content": "special <|im_end|> inside"}],
]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "tiny-bpe"
    build(out, seed=0)
    return out


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_built_directory_is_a_small_qwen2_that_transformers_loads(built):
    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    generation = json.loads((built / "generation_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(built)
    model = transformers.AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert 1_000 <= len(tok) <= 2_000 and config["vocab_size"] == len(tok)
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 3_000_000
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.eos_token_id == im_end and tok.pad_token_id == endoftext
    assert config["eos_token_id"] == im_end and config["pad_token_id"] == endoftext
    assert generation["eos_token_id"] == [im_end, endoftext] and generation["pad_token_id"] == endoftext
    # Byte-level BPE: any text round-trips, and merges make common text shorter than its bytes.
    text = "Grace has 35 cards.\n#### 19 — naïve café"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text.encode()) * 0.6

    ours = Qwen2ForCausalLM.from_pretrained(built)
    ids = torch.tensor(tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True)["input_ids"])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), model(ids[None]).logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_ids_equal_transformers_apply_chat_template(built, add_generation_prompt):
    hf = transformers.AutoTokenizer.from_pretrained(built)
    ours = load_tokenizer(built)
    assert isinstance(ours, HFTokenizer)
    assert (ours.vocab_size, ours.eos_token_id, ours.pad_token_id) == (
        len(hf),
        hf.eos_token_id,
        hf.pad_token_id,
    )
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert got == list(expected["input_ids"])
        assert ours.decode(got) == hf.decode(got)
        assert ours.decode(got, skip_special_tokens=True) == hf.decode(got, skip_special_tokens=True)
    # Qwen's template: a default system turn when the conversation has none, the assistant header last.
    text = ours.decode(ours.apply_chat_template(CONVERSATIONS[0]))
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.decode([ours.vocab_size])


@pytest.mark.slow  # two more builds
def test_build_is_deterministic_and_the_seed_only_changes_the_weights(built, tmp_path):
    build(tmp_path / "again", seed=0)
    build(tmp_path / "other", seed=1)
    first, again, other = _digest(built), _digest(tmp_path / "again"), _digest(tmp_path / "other")
    assert again == first
    assert other["tokenizer.json"] == first["tokenizer.json"]
    assert other["model.safetensors"] != first["model.safetensors"]


def test_bad_sizes_are_refused_before_anything_is_written(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "bad"), "--heads", "3", "--kv-heads", "2"])
    assert "num_attention_heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "bad"), "--vocab-size", "100"])
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("beside_a_qwen2_config", [False, True])
def test_char_tokenizer_as_hf_files_gives_char_tokenizer_ids(tmp_path, beside_a_qwen2_config):
    # Beside a qwen2 config.json (as in an export) transformers 5 loads it as Qwen2Tokenizer.
    write_char_tokenizer(tmp_path)
    if beside_a_qwen2_config:
        (tmp_path / "config.json").write_text(json.dumps(ModelConfig.tiny().to_hf_dict()))
    char = CharTokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    wrapped = HFTokenizer.from_directory(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), CharTokenizer)  # the marker keeps it a CharTokenizer
    assert (len(hf), hf.eos_token_id, hf.pad_token_id) == (101, char.eos_token_id, char.pad_token_id)
    every_id = list(range(char.vocab_size))
    assert hf.decode(every_id) == wrapped.decode(every_id) == char.decode(every_id)
    for text in ["rev 1234", "a\tb\n  c\n\n", "<|im_start|>user\nhi<|im_end|>\n", "x  \t\n y!?'s 'LL"]:
        assert hf.encode(text, add_special_tokens=False) == char.encode(text) == wrapped.encode(text)
    # Outside CharTokenizer's vocabulary the HF files drop a character where CharTokenizer writes '?'.
    assert hf.encode("é1", add_special_tokens=False) == wrapped.encode("é1") == char.encode("1")
    for messages in CONVERSATIONS[:1] + CONVERSATIONS[2:]:
        expected = list(
            hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        )
        assert char.apply_chat_template(messages) == expected == wrapped.apply_chat_template(messages)


def test_the_hf_math_recipe_names_the_directory_the_tool_builds(built, tmp_path, monkeypatch):
    recipe_file = Path(__file__).resolve().parents[3] / "configs" / "hf_math_grpo.toml"
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny-bpe-qwen2").symlink_to(built)
    monkeypatch.chdir(tmp_path)  # relative model paths are the services' working directory's
    recipe = load_recipe(recipe_file)
    assert recipe.environment.name == "math" and recipe.model.tokenizer == recipe.model.path
    assert "tools/build_hf_model.py --out models/tiny-bpe-qwen2" in recipe_file.read_text()
    assert isinstance(load_tokenizer(recipe.model.tokenizer), HFTokenizer)
    spec = spec_from_recipe(recipe, "hf-math")
    model = spec.recipe.model
    assert model.path == model.tokenizer == "models/tiny-bpe-qwen2" and spec.recipe.run.steps > 0


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_a_multi_turn_episode_extends_its_ids_as_the_template_renders_the_whole_conversation(built, kind):
    tok = CharTokenizer() if kind == "char" else load_tokenizer(built)
    hf = None if kind == "char" else transformers.AutoTokenizer.from_pretrained(built)
    conversation = [
        {"role": "user", "content": "Guess my number between 1 and 9."},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "Higher."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Correct!"},
    ]
    # What an agent loop holds: the prompt, then per turn the model's tokens (ending with eos) and
    # the continuation that appends the environment's reply.
    ids = tok.apply_chat_template(conversation[:1])
    for turn in (1, 3):
        ids += [*tok.encode(conversation[turn]["content"]), tok.eos_token_id]
        ids += tok.chat_continuation(conversation[: turn + 1], conversation[turn + 1 : turn + 2])
    assert ids == tok.apply_chat_template(conversation)
    if hf is not None:
        assert ids == list(hf.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"])
        assert tok.decode(ids).count("You are a helpful assistant.") == 1


@pytest.mark.slow  # two builds with a few training steps each
def test_the_warm_start_is_deterministic_and_lowers_the_answer_loss(tmp_path):
    first = build(tmp_path / "a", seed=0, sft_steps=4)
    second = build(tmp_path / "b", seed=0, sft_steps=4)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert second["last_loss"] == first["last_loss"] < first["first_loss"]
    assert "4 SFT steps" in (tmp_path / "a" / "README.md").read_text()


def test_a_warm_start_on_an_environments_tasks_teaches_their_answers(tmp_path):
    examples = environment_examples("digits", {"min_len": 1, "max_len": 1, "ops": ["copy"]}, 64, seed=1)
    # Rendered as the environment-sandbox opens an episode, with its reference answer.
    assert all(messages == [{"role": "user", "content": f"copy {answer}"}] for messages, answer in examples)
    assert {answer for _, answer in examples} == set("0123456789")
    summary = build(
        tmp_path / "m", seed=0, hidden_size=32, intermediate_size=64, sft_steps=3, sft_examples=examples
    )
    assert summary["last_loss"] < summary["first_loss"]
    assert "3 SFT steps on 64 given answers" in (tmp_path / "m" / "README.md").read_text()


def test_a_warm_start_learns_an_environments_worked_solutions_where_its_tasks_have_them():
    examples = environment_examples("math", {}, 8, seed=0)
    for index, (messages, target) in enumerate(examples):
        task = task_by_index("math", index, 0, {})
        assert messages[0]["content"].startswith(task["question"])
        assert target == task["solution"] and target.endswith(f"#### {task['answer']}")
