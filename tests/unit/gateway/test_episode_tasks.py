"""The gateway's episode tasks carry what the environment needs of the run: here, its tokenizer."""

from __future__ import annotations

from gateway.runs import episode_tasks
from services.kit.config.recipe import RunRecord, parse_recipe
from services.modeling.tokenizer import CharTokenizer


def test_every_episode_task_names_the_runs_tokenizer(tmp_path):
    CharTokenizer().save_pretrained(tmp_path / "tok")
    for tokenizer, fork in (("char", "true"), (str(tmp_path / "tok"), "false")):
        text = f'[model]\ntokenizer = "{tokenizer}"\n[batch]\nrollouts_per_step = 8\ngroup_size = 4\nfork_groups = {fork}\n'
        record = RunRecord(run_id="r", recipe_toml=text)
        tasks = episode_tasks(record, parse_recipe(text), step=0)
        assert len(tasks) == (2 if fork == "true" else 8)
        assert {task.tokenizer for _, task in tasks} == {tokenizer}
