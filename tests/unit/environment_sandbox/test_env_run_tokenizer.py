"""Episodes are tokenized with the run's tokenizer: for the Hugging Face-format model that
tools/build_hf_model.py builds, the ids the agent loop hands the generator (where the
inference-router would be) are what `transformers.AutoTokenizer.apply_chat_template` gives for the
same conversation, turn after turn; tokenizers are loaded once per spec; a missing tokenizer
directory is a bad task naming model.tokenizer, and recipes naming one are refused."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import transformers

from looprl.common.v1 import common_pb2
from looprl.events.v1 import events_pb2
from services.environment_sandbox.agent_loop import EpisodeRunner, ModelTurn, OneAtATime
from services.environment_sandbox.environments import EnvironmentError_
from services.kit.config.recipe import RecipeError, parse_recipe
from services.modeling.hf_tokenizer import HFTokenizer
from services.modeling.tokenizer import CharTokenizer, TokenizerCache, load_tokenizer
from tools.build_hf_model import build


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "tiny-bpe"
    build(out, seed=0)
    return out


class RecordingGenerator:
    """Stands where the inference-router is: records each prompt, replies `replies[turn]` + eos."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tokenizer, self.replies, self.prompts = tokenizer, replies, []

    async def __call__(self, prompt_ids, sampling, session_id, min_weight_version):
        reply = self.replies[min(len(self.prompts), len(self.replies) - 1)]
        self.prompts.append(list(prompt_ids))
        ids = [*self.tokenizer.encode(reply), self.tokenizer.eos_token_id]
        return ModelTurn(ids, [-0.5] * len(ids), "stop", 0)


def _task(
    environment: str, payload: dict, tokenizer: str, config: dict | None = None
) -> events_pb2.EpisodeTask:
    return events_pb2.EpisodeTask(
        run_id="r",
        task_id="t",
        group_id="g",
        environment=environment,
        task_json=json.dumps(payload),
        environment_config_json=json.dumps(config or {}),
        sampling=common_pb2.SamplingParams(max_tokens=8),
        tokenizer=tokenizer,
    )


def _hf_ids(hf, messages: list[dict], generation_prompt: bool = True) -> list[int]:
    return list(
        hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)["input_ids"]
    )


async def test_a_chat_turn_is_sent_as_transformers_renders_it(hf_dir):
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    generator = RecordingGenerator(load_tokenizer(hf_dir), ["4321"])
    # The service's default tokenizer is char: the task's tokenizer (the run's) wins.
    runner = EpisodeRunner(OneAtATime(generator), None, TokenizerCache("char"))
    rollout = await runner.run(_task("digits", {"digits": "1234"}, str(hf_dir)))
    (prompt,) = generator.prompts
    assert prompt == _hf_ids(hf, [{"role": "user", "content": "rev 1234"}])
    assert list(rollout.turns[0].token_ids) == prompt
    assert rollout.turns[0].text == hf.decode(prompt)
    assert rollout.turns[1].text == "4321<|im_end|>"


async def test_a_multi_turn_guess_extends_the_ids_as_the_template_renders_the_whole_conversation(hf_dir):
    hf = transformers.AutoTokenizer.from_pretrained(hf_dir)
    replies = ["8", "12", "10"]
    generator = RecordingGenerator(load_tokenizer(hf_dir), replies)
    runner = EpisodeRunner(OneAtATime(generator), None, TokenizerCache("char"))
    task = _task("guess", {"secret": 10, "high": 16}, str(hf_dir), {"max_turns": 4})
    rollout = await runner.run(task)
    conversation = [
        {"role": "user", "content": "guess 1-16"},
        {"role": "assistant", "content": "8"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "lower"},
        {"role": "assistant", "content": "10"},
    ]
    # Each turn's request is the whole conversation so far, as the template renders it ...
    assert generator.prompts == [_hf_ids(hf, conversation[:end]) for end in (1, 3, 5)]
    # ... and the rollout's ids are the template's rendering of the finished conversation (which
    # ends with the newline Qwen's template puts after the last <|im_end|>).
    ids = [t for turn in rollout.turns for t in turn.token_ids]
    assert ids == _hf_ids(hf, conversation, generation_prompt=False)[:-1]
    assert [t.role for t in rollout.turns] == [
        common_pb2.ROLE_USER,
        *[common_pb2.ROLE_ASSISTANT, common_pb2.ROLE_ENVIRONMENT] * 2,
        common_pb2.ROLE_ASSISTANT,
    ]
    assert rollout.reward > 0 and rollout.finish_reason == "stop"


async def test_tasks_without_a_tokenizer_keep_the_char_template(hf_dir):
    generator = RecordingGenerator(CharTokenizer(), ["3"])
    runner = EpisodeRunner(OneAtATime(generator), None, CharTokenizer())
    await runner.run(_task("digits", {"digits": "3"}, ""))
    assert generator.prompts == [
        CharTokenizer().encode("<|im_start|>user\nrev 3<|im_end|>\n<|im_start|>assistant\n")
    ]


async def test_a_missing_tokenizer_directory_is_a_bad_task_naming_model_tokenizer(tmp_path):
    runner = EpisodeRunner(OneAtATime(RecordingGenerator(CharTokenizer(), ["1"])), None, TokenizerCache())
    with pytest.raises(
        EnvironmentError_,
        match=r"^task\.tokenizer \(the run's model\.tokenizer\): .*nope' is neither 'char' nor",
    ):
        await runner.run(_task("digits", {"digits": "1"}, str(tmp_path / "nope")))


async def test_each_tokenizer_is_loaded_once_however_many_episodes_ask_at_once(hf_dir, monkeypatch):
    import services.modeling.tokenizer as module

    loads = []
    real = module.load_tokenizer
    monkeypatch.setattr(module, "load_tokenizer", lambda spec: loads.append(spec) or real(spec))
    cache = TokenizerCache("char")
    spelled = [str(hf_dir), str(hf_dir) + "/", str(hf_dir / ".." / hf_dir.name)]
    got = await asyncio.gather(
        *(cache.aget(spec) for spec in spelled * 4), cache.aget(""), cache.aget("char")
    )
    assert sorted(loads) == sorted([str(hf_dir), "char"])
    assert all(t is got[0] for t in got[:12]) and isinstance(got[0], HFTokenizer)
    assert got[12] is got[13] and isinstance(got[12], CharTokenizer)
    assert cache.get(str(hf_dir)) is got[0] and len(loads) == 2


def test_a_recipe_naming_a_missing_tokenizer_directory_is_refused(tmp_path, hf_dir):
    refusals = []
    for spec in (tmp_path / "nope", tmp_path):  # missing, and a directory without a tokenizer
        with pytest.raises(RecipeError, match=r"^model\.tokenizer: .*tokenizer directory") as err:
            parse_recipe(f'[model]\ntokenizer = "{spec}"\n')
        refusals.append(str(err.value).replace(str(spec), "<spec>"))
    assert refusals[0] == refusals[1]  # one answer: it tells nothing of what the host holds
    assert parse_recipe(f'[model]\ntokenizer = "{hf_dir}"\n').model.tokenizer == str(hf_dir)
