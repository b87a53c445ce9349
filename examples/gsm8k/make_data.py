"""Writes GSM8K-format files for examples/gsm8k.yaml (``python examples/gsm8k/make_data.py``): word problems with a
worked answer ending in ``#### N``, the format of GSM8K's own jsonl files (``question``, ``answer``). Point task.file
at the real GSM8K train/test files (and model.path at a real model) for the real recipe.

train.jsonl: 10000 problems (the recipe's SFT split is the first task.n_sft, its RL prompts the next task.n_rl);
test.jsonl: 500 others. The numbers run to 99 and no two problems share a calculation (the same numbers and
operation under other names), so a model passes the test split by carrying and borrowing, not by recalling a
training problem.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = ["Ann", "Ben", "Cal", "Dee", "Eli", "Fay"]
THINGS = ["apples", "books", "coins", "pens", "cards"]
N_TRAIN, N_TEST = 10000, 500
rng = random.Random(0)
seen: set[tuple[str, int, int]] = set()
rows: list[dict] = []
while len(rows) < N_TRAIN + N_TEST:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if rng.random() < 0.5:
        key = ("+", a, b)
        q = f"{who} has {a} {what} and gets {b} more. How many {what} now?"
        ans = f"{a} + {b} = {a + b}\n#### {a + b}"
    else:
        a, b = max(a, b), min(a, b)
        key = ("-", a, b)
        q = f"{who} has {a} {what} and gives away {b}. How many {what} are left?"
        ans = f"{a} - {b} = {a - b}\n#### {a - b}"
    if key not in seen:
        seen.add(key)
        rows.append({"question": q, "answer": ans})
for name, part in (("train", rows[:N_TRAIN]), ("test", rows[N_TRAIN:])):
    with open(HERE / f"{name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in part)
