"""Writes small GSM8K-format files for examples/gsm8k.yaml (``python examples/gsm8k/make_data.py``): word problems
with a worked answer ending in ``#### N``, the format of GSM8K's own jsonl files (``question``, ``answer``).
Point task.file at the real GSM8K train/test files (and model.path at a real model) for the real recipe.

train.jsonl: 2000 problems; test.jsonl: 200 others.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = ["Ann", "Ben", "Cal", "Dee", "Eli", "Fay"]
THINGS = ["apples", "books", "coins", "pens", "cards"]
rng = random.Random(0)
seen: set[str] = set()
rows: list[dict] = []
while len(rows) < 2200:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    if rng.random() < 0.5:
        q = f"{who} has {a} {what} and gets {b} more. How many {what} now?"
        ans = f"{a} + {b} = {a + b}\n#### {a + b}"
    else:
        a, b = max(a, b), min(a, b)
        q = f"{who} has {a} {what} and gives away {b}. How many {what} are left?"
        ans = f"{a} - {b} = {a - b}\n#### {a - b}"
    if q not in seen:
        seen.add(q)
        rows.append({"question": q, "answer": ans})
for name, part in (("train", rows[:2000]), ("test", rows[2000:])):
    with open(HERE / f"{name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in part)
