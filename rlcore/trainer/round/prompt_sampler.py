"""The prompts of a round's steps: epoch-shuffled and seeded, with the state a step checkpoint keeps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class PromptSampler:
    """Epoch-shuffled prompt indices, seeded: the same params give the same prompt order."""

    size: int
    seed: int
    order: np.ndarray = field(init=False)
    pos: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.order = self.rng.permutation(self.size)

    def take(self, n: int) -> np.ndarray:
        out: list[int] = []
        while len(out) < n:
            if self.pos == self.size:
                self.order, self.pos = self.rng.permutation(self.size), 0
            step = min(n - len(out), self.size - self.pos)
            out.extend(self.order[self.pos : self.pos + step])
            self.pos += step
        return np.asarray(out)

    def state_dict(self) -> dict[str, Any]:
        """The order, the position in it and the RNG: what a step checkpoint keeps, so a resumed round draws the
        prompts the uninterrupted one would."""
        return {"order": self.order.copy(), "pos": self.pos, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order, self.pos = state["order"], state["pos"]
        self.rng.bit_generator.state = state["rng"]
