"""rlcore.names lists, for light validation, exactly the names of the registries params.yaml selects from."""

from __future__ import annotations

import pytest

from rlcore import names
from rlcore.agents import LOOPS
from rlcore.agents.parsers import PARSERS
from rlcore.algos.advantage import ESTIMATORS
from rlcore.algos.aggregation import LOSS_AGG_MODES
from rlcore.algos.kl import KL_ESTIMATORS
from rlcore.algos.kl_control import KL_CONTROLLERS
from rlcore.algos.losses import POLICY_LOSSES
from rlcore.data.splits import TASKS
from rlcore.engine.strategy import STRATEGIES
from rlcore.rollout import ENGINES
from rlcore.trainer.round.modes import ROUND_MODES

PAIRS = {
    "ADV_ESTIMATORS": ESTIMATORS, "POLICY_LOSSES": POLICY_LOSSES, "KL_ESTIMATORS": KL_ESTIMATORS,
    "LOSS_AGG_MODES": LOSS_AGG_MODES, "KL_CONTROLLERS": KL_CONTROLLERS, "STRATEGIES": STRATEGIES,
    "ROLLOUT_ENGINES": ENGINES, "TASKS": TASKS, "PPO_MODES": ROUND_MODES, "AGENT_LOOPS": LOOPS,
    "TOOL_PARSERS": PARSERS,
}


@pytest.mark.parametrize("attr", sorted(PAIRS))
def test_light_names_equal_the_registry(attr):
    assert sorted(getattr(names, attr)) == PAIRS[attr].names()


def test_behaviour_old_policy_losses_are_those_whose_entry_says_so():
    assert sorted(names.BEHAVIOUR_OLD_POLICY_LOSSES) == [n for n in POLICY_LOSSES.names()
                                                         if POLICY_LOSSES.get(n).old_is_behaviour]


def test_greedy_baseline_estimators_are_those_whose_entry_needs_one():
    assert sorted(names.GREEDY_BASELINE_ESTIMATORS) == [n for n in ESTIMATORS.names()
                                                        if ESTIMATORS.get(n).needs_greedy_baseline]


def test_teacher_estimators_are_those_whose_entry_needs_a_teacher():
    assert names.TEACHER_ESTIMATORS and sorted(names.TEACHER_ESTIMATORS) == [
        n for n in ESTIMATORS.names() if ESTIMATORS.get(n).needs_teacher]


def test_rejection_options_equal_the_loss_module_s():
    from rlcore.algos.off_policy import REJECTION_OPTIONS

    assert names.REJECTION_OPTIONS == REJECTION_OPTIONS


def test_sharded_strategies_are_those_whose_entry_shards():
    assert sorted(names.SHARDED_STRATEGIES) == [n for n in STRATEGIES.names() if STRATEGIES.get(n).shards]


def test_check_name_lists_the_allowed_names():
    assert names.check_name("task", "gsm8k", names.TASKS) == "gsm8k"
    with pytest.raises(ValueError, match="unknown task 'mnist'; allowed: arithmetic, calculator, file, gsm8k"):
        names.check_name("task", "mnist", names.TASKS)
