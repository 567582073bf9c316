"""The reward of the single-turn example: a plain function, loaded by the reward service from a
plugin directory (`looprl up --plugin-dir examples/single_turn`) and named in the recipe as
`reward.function = "rewards.py:score"`.

looprl calls it once per episode with the task's prompt, the model's answer and the task's reference
answer; the row's other columns (here `source`) arrive as keyword arguments. Keyword parameters with
defaults are the reward's settings (`reward.config`), checked when the run is created.
"""


def score(prompt: str, completion: str, answer: str, *, format_weight: float = 0.5, **metadata) -> dict:
    """Partial credit: the share of the answer made of digits, and of the reference's digits in place."""
    text = completion.strip()
    if not text:
        return {"score": 0.0, "format": 0.0, "correct": 0.0}
    digits = sum(c.isdigit() for c in text) / len(text)
    correct = sum(a == b for a, b in zip(text, answer, strict=False)) / len(answer)
    total = format_weight * digits + (1.0 - format_weight) * correct
    return {"score": total, "format": digits, "correct": correct}
