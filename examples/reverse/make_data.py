"""Writes this example's data: words of 3-6 letters to reverse (``python examples/reverse/make_data.py``).

train.jsonl: 5000 rows with a demonstration (the first task.n_sft are the SFT split, the rest RL prompts);
test.jsonl: 500 other words. Columns: prompt, answer (the ground truth: the exact reversal), demonstration (what
an annotator wrote), length (carried into extra_info, where the reward function reads it).

The demonstrations are a careless annotator's, as a real data set's often are: on words of five or six letters,
SLIP_RATE of them swap the reversal's first two letters (``reverse planet`` -> ``ntelap`` for ``tenalp``), so the
SFT model learns the slip on long words and leaves the round something to fix; the answer column is always right.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SLIP_RATE = 0.6  # share of the long words' demonstrations with the slip
SLIP_FROM = 5  # shortest word whose demonstration may have it
rng = random.Random(0)
words: list[str] = []
seen: set[str] = set()
while len(words) < 5500:
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 6)))
    if word not in seen:
        seen.add(word)
        words.append(word)
for name, part in (("train", words[:5000]), ("test", words[5000:])):
    with open(HERE / f"{name}.jsonl", "w") as f:
        for w in part:
            answer = w[::-1]
            slip = name == "train" and len(w) >= SLIP_FROM and rng.random() < SLIP_RATE
            demonstration = answer[1] + answer[0] + answer[2:] if slip else answer
            f.write(json.dumps({"prompt": f"reverse {w}", "answer": answer, "demonstration": demonstration,
                                "length": len(w)}) + "\n")
