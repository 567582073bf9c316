"""A run whose tasks come from two sources with different output lengths, built offline.

`two_source_rows` writes math-environment rows of two sources: "brief" problems answered with the
bare number ("#### 17": a few tokens) and "worked" problems answered at great length (a long working
with no full stop until its end, so the model learns to keep writing until max_tokens). A tiny
Hugging Face-format Qwen2 warm-started on such rows (`build_two_source_model`) answers each source in
its own length as a trained policy would: the same sampling settings, very different lengths.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tools.build_hf_model import build
from tools.hf_warm_start import environment_examples

BRIEF, WORKED = "brief", "worked"
BRIEF_ASK = "Reply with the number only."
WORKED_ASK = "Explain every step at great length."
# No full stop inside: the answer's only "." comes right before its "####", so a model taught on it
# rarely stops before max_tokens.
FILLER = "and then we add the numbers again and check them with care "


def two_source_rows(count: int, seed: int, filler_repeats: int = 30) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        if i % 2 == 0:
            question = f"Ann has {a} apples and buys {b} more. How many apples? {BRIEF_ASK}"
            rows.append({"question": question, "answer": f"#### {a + b}", "source": BRIEF})
        else:
            question = f"Tom has {a} pens and finds {b} more. How many pens? {WORKED_ASK}"
            answer = FILLER * filler_repeats + f". #### {a + b}"
            rows.append({"question": question, "answer": answer, "source": WORKED})
    return rows


def write_rows(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def source_of(prompt_text: str) -> str:
    """Which source a rendered prompt came from."""
    return BRIEF if BRIEF_ASK in prompt_text else WORKED


def build_two_source_model(out: Path, sft_steps: int = 250) -> dict:
    """A ~70k-parameter BPE Qwen2 warm-started on both sources (rows of another seed than the run's),
    rendered as the math environment renders them."""
    train = write_rows(out.parent / "two_source_train.jsonl", two_source_rows(256, seed=1))
    examples = environment_examples("math", {"dataset": str(train)}, 256, seed=1)
    return build(
        out,
        seed=0,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        sft_steps=sft_steps,
        sft_examples=examples,
    )
