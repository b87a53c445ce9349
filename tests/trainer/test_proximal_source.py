"""Where a round's old log-probs come from, chosen by the params alone (no Ray): one rule for recomputing them
(``rlcore.config.needs_recompute``), used by the config's checks and by the round alike."""

from __future__ import annotations

import pytest

from rlcore.config import ConfigError, parse_config
from rlcore.trainer.round.ppo_step import proximal_source
from rlcore.workers.proximal import FirstForwardLogProbs, RecomputedLogProbs, RolloutLogProbs

ASYNC = {"mode": "async", "async": {"max_staleness": 1}}


@pytest.mark.parametrize("actor, ppo, algorithm, source", [
    ({}, {}, {}, RolloutLogProbs),
    ({"recompute_log_prob": True}, {}, {}, RecomputedLogProbs),  # 2 mini-batches of the default 32 prompts
    ({"recompute_log_prob": True, "ppo_mini_batch_size": 32}, {}, {}, FirstForwardLogProbs),
    ({"recompute_log_prob": True, "ppo_mini_batch_size": 32}, {}, {"use_kl_in_reward": True}, RecomputedLogProbs),
    ({"recompute_log_prob": True, "ppo_mini_batch_size": 32, "ppo_epochs": 2}, {}, {}, RecomputedLogProbs),
    ({}, ASYNC, {}, RecomputedLogProbs),
    ({}, {"mode": "async", "async": {"max_staleness": 0}}, {}, RolloutLogProbs),
    ({"loss": {"name": "bypass_mode"}}, ASYNC, {}, RolloutLogProbs),
])
def test_the_source_follows_recompute_staleness_the_loss_and_the_update_shape(actor, ppo, algorithm, source):
    cfg = parse_config({"actor": actor, "ppo": ppo, "algorithm": algorithm, "resources": {"n_workers": 1}})
    assert type(proximal_source(cfg)) is source


@pytest.mark.parametrize("actor, ppo", [({}, {}), ({"recompute_log_prob": True}, {}), ({}, ASYNC),
                                        ({}, {"mode": "async", "async": {"max_staleness": 0}})])
def test_a_correction_is_accepted_exactly_where_the_round_recomputes(actor, ppo):
    """``actor.off_policy`` compares the rollout's log-probs with recomputed ones: the config accepts it where the
    round's source is not the rollout's own, and refuses it, in one line, where it is."""
    raw = {"actor": {**actor, "off_policy": {"correction": "tis"}}, "ppo": ppo, "resources": {"n_workers": 1}}
    recomputed = type(proximal_source(parse_config({**raw, "actor": actor}))) is not RolloutLogProbs
    if recomputed:
        assert parse_config(raw).actor.off_policy.correction == "tis"
    else:
        with pytest.raises(ConfigError, match="actor.off_policy.correction tis compares"):
            parse_config(raw)
