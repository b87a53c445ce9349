"""A round's held-out check (``ppo.val_every``): greedy pass@1 of the policy on the held-out prompts before the first
step, every ``val_every`` steps and after the last (``val/*``). Reported only: nothing is selected on it."""

from __future__ import annotations

from typing import Any

from rlcore.config import Config
from rlcore.data.collate import prompt_batch
from rlcore.protocol import Batch, Metrics
from rlcore.rewards.checks import read_reward_rows
from rlcore.trainer.loop.checkpoint import Resume
from rlcore.trainer.round.runner import RoundRunner


class Validation:
    """The validations of one round of ``steps`` steps on ``prompts`` every ``every`` steps (0: none). Its
    :attr:`rows` go into the round's summary, and a step checkpoint keeps them."""

    def __init__(self, prompts: Batch, every: int, steps: int):
        self.prompts, self.every, self.steps = prompts, every, steps
        self.rows: list[Metrics] = []

    @classmethod
    def read(cls, cfg: Config, path: str | None, tokenizer, tools: list[dict] | None, steps: int) -> Validation:
        """The held-out prompts of ``path`` (rows of the pipeline's schema, shown the tool loop's ``tools``), when
        there is a file and ``ppo.val_every`` asks for validations."""
        every = cfg.ppo.val_every if path else 0
        if not (path and every):
            return cls(Batch(), 0, steps)
        rows = read_reward_rows(path, cfg.reward)
        return cls(prompt_batch(rows, tokenizer, cfg.task.max_prompt_length, path, tools), every, steps)

    def begin(self, runner: RoundRunner, tracker, resume: Resume | None) -> Metrics:
        """At the round's start: the rows a resumed round kept, or the validation of the model the round starts
        from, logged at step 0 and returned for step 0's row (a validation after step 0's update wins there)."""
        if resume is not None:
            self.rows = list(resume.state["val_rows"])
            return {}
        if not self.every:
            return {}
        self.rows.append(runner.validate(self.prompts))
        tracker.log_metrics(self.rows[-1], step=0)
        return dict(self.rows[0])

    def after(self, step: int, runner: RoundRunner) -> Metrics:
        """The validation that follows ``step``'s update when one is due (every ``every`` steps and after the
        last), else nothing: logged in that step's row."""
        if not self.every or ((step + 1) % self.every and step + 1 != self.steps):
            return {}
        self.rows.append(runner.validate(self.prompts))
        return self.rows[-1]

    def state(self) -> dict[str, Any]:
        """What a step checkpoint keeps of it."""
        return {"val_rows": self.rows}
