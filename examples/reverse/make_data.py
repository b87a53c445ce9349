"""Writes this example's data: words of 3-6 letters to reverse (``python examples/reverse/make_data.py``).

train.jsonl: 3000 rows with a demonstration (the first task.n_sft are the SFT split, the rest RL prompts);
test.jsonl: 200 other words. Columns: prompt, answer (the ground truth), demonstration, length (carried into
extra_info, where the reward function reads it).
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
rng = random.Random(0)
words: list[str] = []
seen: set[str] = set()
while len(words) < 3200:
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
    if word not in seen:
        seen.add(word)
        words.append(word)
for name, part in (("train", words[:3000]), ("test", words[3000:])):
    with open(HERE / f"{name}.jsonl", "w") as f:
        for w in part:
            f.write(json.dumps({"prompt": f"reverse {w}", "answer": w[::-1], "demonstration": w[::-1],
                                "length": len(w)}) + "\n")
