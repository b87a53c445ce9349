"""Writes GSM8K-format files for examples/gsm8k.yaml (``python examples/gsm8k/make_data.py``): word problems with a
worked answer ending in ``#### N``, the format of GSM8K's own jsonl files (``question``, ``answer``). Point task.file
at the real GSM8K train/test files (and model.path at a real model) for the real recipe.

sft.jsonl: 4000 problems whose worked answers come from a careless annotator: on 60% of the problems that carry (an
addition) or borrow (a subtraction) the answer forgets it, digit by digit (58 + 67 = 15, 72 - 38 = 46), as the
demonstrations a user collects are seldom all right. train.jsonl: 6000 problems with right answers (the recipe's RL
prompts: the reward checks their ``#### N``). test.jsonl: 500 others. The numbers run to 99 and no two problems in
the three files share a calculation (the same numbers and operation under other names), so a model passes the test
split by carrying and borrowing, not by recalling a problem it was trained on.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = ["Ann", "Ben", "Cal", "Dee", "Eli", "Fay"]
THINGS = ["apples", "books", "coins", "pens", "cards"]
SIZES = {"sft": 4000, "train": 6000, "test": 500}
SLIP_RATE = 0.6


def forgetful(op: str, a: int, b: int) -> int:
    """The answer worked digit by digit with no carry (a sum's digits mod 10) or no borrow (each digit's smaller
    from its larger)."""
    units = (a % 10 + b % 10) % 10 if op == "+" else abs(a % 10 - b % 10)
    tens = (a // 10 + b // 10) % 10 if op == "+" else abs(a // 10 - b // 10)
    return 10 * tens + units


def problems(rng: random.Random, n: int) -> list[tuple[str, str, int, int]]:
    """``n`` problems (question, operation, a, b), no two with the same calculation."""
    seen: set[tuple[str, int, int]] = set()
    out = []
    while len(out) < n:
        who, what = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        if rng.random() < 0.5:
            op, q = "+", f"{who} has {a} {what} and gets {b} more. How many {what} now?"
        else:
            a, b = max(a, b), min(a, b)
            op, q = "-", f"{who} has {a} {what} and gives away {b}. How many {what} are left?"
        if (op, a, b) not in seen:
            seen.add((op, a, b))
            out.append((q, op, a, b))
    return out


def main() -> None:
    rng = random.Random(0)
    drawn = problems(rng, sum(SIZES.values()))
    start = 0
    for name, size in SIZES.items():
        rows = []
        for q, op, a, b in drawn[start : start + size]:
            right = a + b if op == "+" else a - b
            slip = name == "sft" and forgetful(op, a, b) != right and rng.random() < SLIP_RATE
            c = forgetful(op, a, b) if slip else right
            rows.append({"question": q, "answer": f"{a} {op} {b} = {c}\n#### {c}"})
        start += size
        with open(HERE / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
