"""Write the text corpus that tools/build_hf_model.py trains its BPE tokenizer on (shipped in tools/data/).

Seeded, so the shipped file is reproducible: `python tools/make_hf_corpus.py --out tools/data/hf_corpus.txt`.
It holds GSM8K-style word problems with worked answers ending in "#### <number>" (the math
environment's format, its generated "Ann has ..." problems included) and short plain-English
sentences, so the merges cover both numbers and ordinary words.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from pathlib import Path

NAMES = [
    "Ann",
    "Ben",
    "Carla",
    "David",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "James",
    "Kofi",
    "Lena",
    "Maria",
    "Nadia",
    "Oscar",
    "Priya",
    "Quentin",
    "Rosa",
    "Samir",
    "Tomas",
    "Uma",
    "Victor",
    "Wendy",
    "Yusuf",
]
ITEMS = [
    "apples",
    "pencils",
    "books",
    "marbles",
    "cookies",
    "stickers",
    "cards",
    "shells",
    "coins",
    "eggs",
    "oranges",
    "cupcakes",
    "balloons",
    "stamps",
    "crayons",
    "muffins",
    "bottles",
    "flowers",
    "toys",
    "bricks",
]
INSTRUCTION = "Solve the problem. End with '#### <number>'."

ENGLISH = [
    "The morning was cold, so she wore a warm coat and walked to the station.",
    "He opened the window and listened to the rain falling on the roof.",
    "Our teacher asked us to read one chapter every night before bed.",
    "The shop on the corner sells fresh bread, milk and vegetables.",
    "They planted tomatoes in the garden and watered them every evening.",
    "A small dog ran across the park, chasing a red ball.",
    "The train left on time and arrived in the city two hours later.",
    "She wrote a letter to her grandmother and posted it on Monday.",
    "We cooked dinner together and talked about the week.",
    "The library is quiet in the afternoon, and many students study there.",
    "After the meeting, the team agreed on a plan for the next month.",
    "The river was wide and calm, and a few boats drifted past.",
    "He fixed the old bicycle and rode it to school the next day.",
    "The children laughed when the clown dropped his hat.",
    "It is important to check your answer before you hand in the test.",
    "The market opens at eight and closes at noon on Saturdays.",
    "Please answer the question clearly and show each step of your work.",
    "The farmer counted his sheep twice to be sure none were missing.",
    "A good friend listens carefully and tells the truth.",
    "The museum has paintings, old maps and a room full of clocks.",
    "Yesterday the weather changed quickly: first sunshine, then thunder, and finally a gentle breeze.",
    "My neighbour repairs watches, radios and sewing machines in a tiny workshop behind his house.",
    "Scientists measure temperature, pressure and humidity to understand how storms develop.",
    "When the orchestra began to play, the audience became silent and nobody moved.",
    "The village bakery prepares bread, pastries and pies long before sunrise.",
    "Travellers should carry water, a map, a flashlight and some extra clothing.",
    "Mathematics helps engineers design bridges that are strong, light and safe.",
    "The committee discussed the budget, the schedule and several important questions.",
    "Children usually enjoy stories about dragons, pirates, wizards and brave explorers.",
    "The hospital hired three nurses, two doctors and a new receptionist this summer.",
    "She practised the piano every afternoon, and her performance improved remarkably.",
    "A thick fog covered the harbour, so the fishermen waited for the morning light.",
    "Volunteers collected litter along the beach and recycled most of the plastic.",
    "The professor explained the experiment slowly, answering every question patiently.",
    "Our family visited the mountains during winter and went skiing almost every day.",
    "Good habits, such as sleeping enough and eating vegetables, keep people healthy.",
    "The journalist interviewed farmers about the drought and the price of wheat.",
    "In autumn the leaves turn yellow, orange and brown before they fall to the ground.",
    "The carpenter measured the wood carefully, cut it, and joined the pieces with glue.",
    "Every student received a notebook, a ruler, an eraser and a calculator.",
    "The festival included music, dancing, traditional food and colourful costumes.",
    "He apologised for arriving late and promised that it would never happen again.",
    "The spacecraft travelled for months before it finally reached the distant planet.",
    "Writing clearly means choosing simple words and organising ideas logically.",
    "The restaurant was crowded, noisy and cheerful, and the waiters were very friendly.",
    "Although the puzzle looked difficult, she solved it in less than ten minutes.",
    "The gardener trimmed the hedges, mowed the lawn and swept the narrow path.",
    "Birds migrate thousands of kilometres each year to find warmer climates.",
    "The electricity failed during the storm, so everybody lit candles and played games.",
    "A careful reader notices details that a hurried reader often misses.",
]


def _add_buy_give(rng: random.Random) -> tuple[str, str]:
    a, b, c = rng.randint(2, 50), rng.randint(2, 50), rng.randint(2, 9)
    question = f"Ann has {a} apples, buys {b} more, then gives away {c}. How many are left?"
    return (
        question,
        f"Ann has {a} + {b} = {a + b} apples. After giving away {c}, {a + b} - {c} = {a + b - c}.",
    )


def _groups(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    boxes, per = rng.randint(2, 12), rng.randint(2, 15)
    question = f"{name} has {boxes} boxes with {per} {item} in each box. How many {item} does {name} have?"
    return question, f"{name} has {boxes} * {per} = {boxes * per} {item}."


def _share(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 9), rng.randint(2, 12)
    total = friends * each
    question = f"{name} shares {total} {item} equally among {friends} friends. How many does each friend get?"
    return question, f"Each friend gets {total} / {friends} = {each} {item}."


def _money(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price, paid_extra = rng.randint(2, 9), rng.randint(2, 20), rng.randint(1, 30)
    cost = count * price
    paid = cost + paid_extra
    question = f"{name} buys {count} {item} for ${price} each and pays with ${paid}. How much change does {name} get?"
    return (
        question,
        f"The {item} cost {count} * {price} = ${cost}. The change is {paid} - {cost} = ${paid_extra}.",
    )


def _time(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(NAMES)
    days, minutes = rng.randint(2, 7), rng.randint(10, 60)
    question = (
        f"{name} reads for {minutes} minutes every day for {days} days. How many minutes is that in total?"
    )
    return question, f"{name} reads {minutes} * {days} = {days * minutes} minutes."


def _two_people(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    x, more = rng.randint(3, 40), rng.randint(2, 20)
    question = (
        f"{a} has {x} {item}. {b} has {more} more {item} than {a}. How many {item} do they have together?"
    )
    y = x + more
    return question, f"{b} has {x} + {more} = {y} {item}. Together they have {x} + {y} = {x + y} {item}."


def _remaining(rng: random.Random) -> tuple[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    start, used1, used2 = rng.randint(30, 99), rng.randint(2, 12), rng.randint(2, 12)
    left = start - used1 - used2
    question = (
        f"{name} had {start} {item}. {name} used {used1} on Monday and {used2} on Tuesday. How many are left?"
    )
    return (
        question,
        f"{name} used {used1} + {used2} = {used1 + used2}. {start} - {used1 + used2} = {left} are left.",
    )


TEMPLATES: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    _add_buy_give,
    _groups,
    _share,
    _money,
    _time,
    _two_people,
    _remaining,
)


def answer_number(solution: str) -> str:
    """The last number of a worked solution (what follows '####')."""
    word = [w.strip("$.") for w in solution.split() if any(ch.isdigit() for ch in w)][-1]
    return word.split("=")[-1]


def corpus(seed: int, problems: int) -> str:
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(problems):
        question, solution = rng.choice(TEMPLATES)(rng)
        lines += [question, INSTRUCTION, f"{solution}\n#### {answer_number(solution)}", ""]
        if i % 4 == 0:
            lines += [" ".join(rng.sample(ENGLISH, 3)), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--problems", type=int, default=1000)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(corpus(args.seed, args.problems))
    print(f"{args.out}: {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
