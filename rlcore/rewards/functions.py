"""Reward functions: the built-in rule and yours, in one registry, combined into one training reward.

A reward function has verl's signature::

    def compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs) -> float | None | dict

and returns a float; ``None`` when it does not apply to the row (it is then left out of that row's sum); or a
dict with ``score`` and extra values, whose means are logged (``reward/<name>/<key>``). ``batched: true``
functions take lists and return a list; ``async def`` functions run on many samples at once. Every function
runs guarded, in the scoring processes (:mod:`rlcore.rewards.guard`).

``params.yaml`` lists yours under ``reward.functions`` (``[{path, name, weight, kwargs, batched}]``); the entry
``rule`` of :data:`REWARD_FUNCTIONS` is the built-in rule of each row's ``data_source`` (``rlcore.rewards.rule``),
weighted by ``reward.rule_weight``. The training reward of a sample is the weighted sum of the functions that
apply to it (TRL's ``reward_weights``), plus the reward model's weighted score (``reward.model``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import cloudpickle

from rlcore.registry import Registry
from rlcore.rewards.guard import FunctionSpec
from rlcore.rewards.rule import RULES


@dataclass(frozen=True)
class RewardFunction:
    """One component of the training reward: its metrics name, how the scoring process gets it, its weight."""

    label: str
    weight: float
    spec_for: Callable[[Sequence[str]], FunctionSpec]
    """The spec for a batch with these data_sources (the rule sends only their rules)."""
    source: str
    """Where it comes from, for messages: ``"rewards/mine.py:compute_score"`` or ``"built-in"``."""
    path: str | None = None


REWARD_FUNCTIONS: Registry[Callable[..., RewardFunction]] = Registry("reward function")
"""Name -> a factory of the component (``weight=``, and for a function from a file ``path=``, ``kwargs=``,
``batched=``): the built-in ``rule`` and, per stage, each of ``reward.functions``."""


def rule_spec(data_sources: Sequence[str]) -> FunctionSpec:
    """The built-in rule for a batch: the rules of its data_sources that have one (by value when they are not
    importable, as a lambda registered by a test)."""
    present = sorted(ds for ds in set(data_sources) if ds in RULES)
    return FunctionSpec("rule", "rules", rules=tuple((ds, cloudpickle.dumps(RULES.get(ds))) for ds in present))


@REWARD_FUNCTIONS.register("rule")
def _rule(*, weight: float = 1.0) -> RewardFunction:
    return RewardFunction("rule", weight, rule_spec, "built-in rule of each data_source")


def from_file(*, path: str, name: str, weight: float = 1.0, kwargs: dict[str, Any] | None = None,
              batched: bool = False) -> RewardFunction:
    """A function ``name`` of the Python file ``path``; the scoring processes import the file themselves."""
    spec = FunctionSpec(name, "file", path=path, name=name, kwargs=tuple(sorted((kwargs or {}).items())),
                        batched=batched)
    return RewardFunction(name, weight, lambda _: spec, f"{path}:{name}", path=path)


def from_callable(label: str, fn: Callable, *, weight: float = 1.0, kwargs: dict[str, Any] | None = None,
                  batched: bool = False) -> RewardFunction:
    """A function object with verl's signature (a test's, or one built in Python), sent by cloudpickle."""
    spec = FunctionSpec(label, "pickled", blob=cloudpickle.dumps(fn), kwargs=tuple(sorted((kwargs or {}).items())),
                        batched=batched)
    return RewardFunction(label, weight, lambda _: spec, getattr(fn, "__qualname__", label))


def components(reward: Any) -> list[RewardFunction]:
    """The reward functions of params.yaml's ``reward`` section: the built-in rule (always: it also decides
    ``acc`` where it applies, even at weight 0), then each of ``reward.functions``."""
    out = [REWARD_FUNCTIONS.get("rule")(weight=reward.rule_weight)]
    for f in reward.functions:
        out.append(from_file(path=f.path, name=f.name, weight=f.weight, kwargs=dict(f.kwargs), batched=f.batched))
    return out
