"""Real PPO steps on Ray workers: every registered estimator, and each config branch of a round.

A hash-of-the-text reward gives every group a spread of rewards from a random tiny model, so each
estimator produces non-zero advantages and the policy must change. One actor/rollout/ref group and
one critic group serve every test (starting worker processes is what costs time here). Each branch
test checks a value the branch changes against the same value worked out independently.
"""

from __future__ import annotations

import csv
import math
import zlib
from contextlib import contextmanager, nullcontext

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from rlcore.algos.advantage import ESTIMATORS
from rlcore.config import parse_config
from rlcore.data.collate import decode_responses, prompt_batch
from rlcore.data.schema import write_rows
from rlcore.engine.model import load_causal_lm, load_tokenizer
from rlcore.engine.sequence import sequences
from rlcore.engine.tiny_model import materialize_tiny
from rlcore.errors import TrainingDiverged
from rlcore.protocol import Batch
from rlcore.rewards.rule import RULES
from rlcore.tracking import NullTracker
from rlcore.engine.sequence import SEQUENCE_KEYS
from rlcore.trainer import ppo
from rlcore.trainer.loop import job
from rlcore.trainer.round import ppo_step
from rlcore.trainer.loop.pool import start_pool
from rlcore.trainer.round.worker_groups import RoundWorkerGroups
from rlcore.trainer.round.ppo_step import ACTOR_UPDATE_KEYS, CRITIC_UPDATE_KEYS, PPOStep, actor_update_spec, critic_update_spec
from rlcore.trainer.round.modes import sync_round_runner
from rlcore.trainer.round.runner import RoundRunner
from rlcore.trainer.round.ppo_step import place_scores
from rlcore.trainer.round.scoring import overlong_penalty
from rlcore.trainer.round.sync_source import keep_informative_groups
from rlcore.viewer import ROLLOUT_COLUMNS, RolloutsFile, read_rollouts
from rlcore.workers.actor import ActorRolloutRefWorker
from rlcore.workers.critic import CriticWorker
from tests.trainer.reward_fns import flaky_reward, hash_reward

HASH_SOURCE = "test_hash"
CONSTANT_SOURCE = "test_constant"


@pytest.fixture(scope="module", autouse=True)
def test_rewards():
    """A deterministic, almost tie-free reward of the text (every group has a spread) and a constant one,
    registered only while this module runs so other tests see the real registry."""
    RULES.register(HASH_SOURCE)(hash_reward)
    RULES.register(CONSTANT_SOURCE)(lambda text, gt: 1.0)
    yield
    for name in (HASH_SOURCE, CONSTANT_SOURCE):
        RULES._items.pop(name)


def rows(source: str, n: int = 8) -> pd.DataFrame:
    return pd.DataFrame([{"data_source": source, "prompt": [{"role": "user", "content": f"{i}+{i}"}], "ability": "t",
                          "reward_model": {"style": "rule", "ground_truth": "0"},
                          "extra_info": {"split": "rl", "index": i, "question": f"{i}+{i}", "answer": ""}}
                         for i in range(n)])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = materialize_tiny(tmp_path_factory.mktemp("tiny"), seed=0, arch="llama", hidden_size=32, num_layers=1,
                              num_heads=2, intermediate_size=64, max_position_embeddings=64)
    tok = load_tokenizer(folder)
    return folder, tok, prompt_batch(rows(HASH_SOURCE), tok, 16, "test rows")


def config(estimator: str, **over):
    raw = {"ray": {"num_cpus": 2}, "tracking": {"enabled": False},
           "rollout": {"n": 4}, "task": {"max_response_length": 5},
           "algorithm": {"adv_estimator": estimator}, "actor": {"ppo_mini_batch_size": 2, "lr": 0.01},
           "ppo": {"train_batch_size": 4}}
    for k, v in over.items():
        raw.setdefault(k, {}).update(v)
    return parse_config(raw)


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(next(folder.glob("*.safetensors"))))


@pytest.fixture(scope="module")
def groups(tiny):
    cfg = config("gae")  # a critic and (KL loss) a reference
    with start_pool(cfg) as pool:
        groups = RoundWorkerGroups.start(cfg, pool, str(tiny[0]))
        yield groups
        groups.shutdown()


def runner_for(cfg, tiny, groups, seed: int = 1, prompts: Batch | None = None) -> RoundRunner:
    _, tok, default = tiny
    return sync_round_runner(cfg, groups, tokenizer=tok, prompts=default if prompts is None else prompts, seed=seed)


def plain_log_probs(model, batch: Batch) -> torch.Tensor:
    """Log-probs of the responses under a plain Hugging Face forward, ``[rows, response_len]``."""
    ids, mask = sequences(batch)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    width = batch["responses"].shape[1]
    return F.log_softmax(logits[:, -width - 1:-1], -1).gather(-1, batch["responses"][..., None])[..., 0]


# distill needs a teacher worker group, which these shared groups do not start: tests/trainer/test_distillation.py
# trains it with one
@pytest.mark.parametrize("estimator", [n for n in ESTIMATORS.names() if not ESTIMATORS.get(n).needs_teacher])
def test_estimator_trains_the_policy(estimator, tiny, groups, tmp_path):
    _, tok, _ = tiny
    runner = runner_for(config(estimator), tiny, groups)
    runner.save(str(tmp_path / "before"))
    metrics = []
    for i in range(2):
        metrics.append(runner.step(i))
        texts = decode_responses(tok, runner.last_batch["responses"], runner.last_batch["response_mask"])
        # the logged accuracy is the mean reward of the texts the policy generated
        assert metrics[-1]["rollout/acc"] == pytest.approx(np.mean([hash_reward(t, "0") for t in texts]), abs=1e-6)
    runner.save(str(tmp_path / "after"))
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values()), m
        assert ("critic/vf_loss" in m) == (estimator == "gae")
    before, after = weights(tmp_path / "before"), weights(tmp_path / "after")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "policy weights did not change"
    assert (tmp_path / "after" / "critic").is_dir() == (estimator == "gae")


NEW_LOSSES = [("dppo_tv", {}), ("dppo_kl", {}), ("sapo", {}), ("dro", {}), ("luspo", {}), ("vespo", {}),
              ("bypass_mode", {}), ("bypass_mode", {"bypass_loss_type": "reinforce", "bypass_is": "token",
                                                    "bypass_rs": "seq_mean_k3", "bypass_rs_threshold": 0.5})]


@pytest.mark.parametrize("loss,extra", NEW_LOSSES)
def test_policy_loss_trains_the_policy(loss, extra, tiny, groups, tmp_path):
    """Each new policy loss and the bnpo aggregation through real updates: finite metrics (the loss's own ones
    included), weights that move. Two mini-batches a step, so the second one's ratios are off 1."""
    cfg = config("grpo", actor={"ppo_mini_batch_size": 2, "lr": 0.01,
                                "loss": {"name": loss, "loss_agg_mode": "bnpo", **extra}})
    runner = runner_for(cfg, tiny, groups, seed=3)
    runner.save(str(tmp_path / "before"))
    rows = [runner.step(i) for i in range(2)]
    runner.save(str(tmp_path / "after"))
    for m in rows:
        assert all(math.isfinite(v) for v in m.values()), m
        assert "timing_s/old_log_prob" not in m  # no recompute: bypass_mode's old policy is the rollout's
    if loss == "bypass_mode":
        assert "actor/is_weight_mean" in rows[-1] and "actor/rejected_frac" in rows[-1]
    before, after = weights(tmp_path / "before"), weights(tmp_path / "after")
    assert any(not torch.equal(before[k], after[k]) for k in before), "policy weights did not change"


def test_optimal_token_baseline_reads_sum_pi_squared_from_a_trainer_forward(tiny, groups, tmp_path):
    """The optimal token baseline needs each position's sum pi^2: a log-prob forward before the advantages
    returns it (the step logs its time), computed from the weights the rollout sampled with at the rollout's
    temperature, as a plain Hugging Face forward gives it; the old log-probs stay the rollout's."""
    cfg = config("optimal_token_baseline", rollout={"n": 4, "temperature": 1.3})
    runner = runner_for(cfg, tiny, groups, seed=7)
    runner.save(str(tmp_path / "now"))
    m = runner.step(0)
    batch = runner.last_batch
    assert "timing_s/old_log_prob" in m and "rollout/logprob_abs_diff_mean" in m
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    ids, attn = sequences(batch)
    with torch.no_grad():
        logits = load_causal_lm(tmp_path / "now")(input_ids=ids, attention_mask=attn,
                                                  position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits.float()
    width = batch["responses"].shape[1]
    expected = torch.softmax(logits[:, -width - 1:-1] / 1.3, -1).square().sum(-1)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(batch["sum_pi_squared"][mask], expected[mask], atol=1e-5, rtol=1e-5)
    # and the advantages are the estimator's on those inputs
    from rlcore.algos.advantage import compute_advantage

    adv, _ = compute_advantage("optimal_token_baseline", token_level_rewards=batch["token_level_rewards"],
                               response_mask=batch["response_mask"], index=batch["uid"],
                               old_log_probs=batch["old_log_probs"], sum_pi_squared=batch["sum_pi_squared"])
    torch.testing.assert_close(batch["advantages"], adv)


def test_gdpo_with_one_reward_component_is_grpo_whitened_over_the_batch(tiny, groups):
    """One reward function (the rule): reward_components is one column, the token rewards' sum, so gdpo's
    advantages are GRPO's on the same rewards, whitened over the valid tokens (and GRPO's exactly without the
    batch whitening)."""
    from rlcore.algos.advantage import compute_advantage
    from rlcore.algos.masked import masked_whiten

    for batch_norm in (True, False):
        runner = runner_for(config("gdpo", algorithm={"adv_estimator": "gdpo", "gdpo_batch_norm": batch_norm}), tiny,
                            groups, seed=8)
        runner.step(0)
        batch = runner.last_batch
        assert batch["reward_components"].shape == (len(batch), 1)
        torch.testing.assert_close(batch["reward_components"][:, 0], batch["token_level_rewards"].sum(-1))
        mask = batch["response_mask"]
        grpo, _ = compute_advantage("grpo", token_level_rewards=batch["token_level_rewards"], response_mask=mask,
                                    index=batch["uid"])
        expected = masked_whiten(grpo, mask) * mask if batch_norm else grpo
        torch.testing.assert_close(batch["advantages"], expected, atol=1e-6, rtol=1e-6)


def test_a_batch_with_reward_components_gives_them_to_gdpo():
    """The Batch field ``reward_components`` (several reward functions) is what gdpo reads when it is there."""
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    token_rewards = torch.tensor([[0.0, 5.0], [0.0, 7.0]])
    with_field = Batch({"reward_components": comps})
    assert torch.equal(PPOStep._estimator_input(with_field, "reward_components", token_rewards), comps)
    fallback = PPOStep._estimator_input(Batch({"scores": torch.tensor([5.0, 7.0])}), "reward_components",
                                            token_rewards)
    assert torch.equal(fallback, torch.tensor([[5.0], [7.0]]))


@pytest.mark.parametrize("estimator,loss", [("optimal_token_baseline", "sapo"), ("gdpo", "bypass_mode")])
def test_a_round_restored_from_its_state_repeats_its_steps(estimator, loss, tiny, groups, tmp_path):
    """Resume: the new estimators and losses keep no state of their own; a round restored from a step's saved
    state (workers' weights, optimizer, RNG; the sampler) runs the next steps exactly as the first time."""
    runner = runner_for(config(estimator, actor={"ppo_mini_batch_size": 2, "lr": 0.01, "loss": {"name": loss}}),
                        tiny, groups, seed=12)
    runner.step(0)
    (tmp_path / "state").mkdir()
    state = runner.save_state(tmp_path / "state")
    first = [runner.step(i) for i in (1, 2)]
    runner.save(str(tmp_path / "first"))
    runner.load_state(tmp_path / "state", state)
    again = [runner.step(i) for i in (1, 2)]
    runner.save(str(tmp_path / "again"))
    for a, b in zip(first, again):
        assert {k: v for k, v in a.items() if not k.startswith(("timing_s/", "perf/"))} == \
            {k: v for k, v in b.items() if not k.startswith(("timing_s/", "perf/"))}
    assert (tmp_path / "first" / "model.safetensors").read_bytes() == (tmp_path / "again" / "model.safetensors").read_bytes()


def test_dapo_dynamic_sampling_retries_only_while_groups_are_uniform(tiny, groups):
    cfg = config("grpo", ppo={"dapo": {"dynamic_sampling": True, "max_sample_tries": 3, "overlong_buffer": 2}},
                 actor={"use_kl_loss": False})
    m = runner_for(cfg, tiny, groups, seed=2).step(0)
    assert m["rollout/sample_tries"] == 1  # the hash reward leaves no group uniform: the first try fills the batch
    assert m["rollout/groups_kept"] == 4
    assert "actor/kl_ref" not in m  # no KL term: the reference is not consulted
    _, tok, _ = tiny
    constant = prompt_batch(rows(CONSTANT_SOURCE), tok, 16, "constant rows")
    m = runner_for(cfg, tiny, groups, seed=2, prompts=constant).step(0)
    assert m["rollout/sample_tries"] == 3  # every group uniform: every try is spent


def test_kl_in_the_reward_uses_the_reference_and_the_adaptive_controller_moves_the_coefficient(tiny, groups):
    """algorithm.use_kl_in_reward: token rewards = outcome score on the last token minus beta * k1(old, ref),
    the reference log-probs being those of the initial model; with the adaptive controller beta then
    moves as Ziegler et al.'s rule says, step by step."""
    folder, _, _ = tiny
    kl_ctrl = {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.01, "horizon": 40}
    cfg = config("grpo", algorithm={"use_kl_in_reward": True, "kl_penalty": "kl", "kl_ctrl": kl_ctrl})
    runner = runner_for(cfg, tiny, groups, seed=4)
    reference = load_causal_lm(folder)
    beta, n = 0.05, 16
    for step in range(2):
        m = runner.step(step)
        batch = runner.last_batch
        ref_lp = plain_log_probs(reference, batch)
        mask = batch["response_mask"].float()
        torch.testing.assert_close(batch["ref_log_probs"] * mask, ref_lp * mask, atol=1e-5, rtol=1e-5)
        kl = (batch["old_log_probs"] - ref_lp) * mask
        expected = place_scores(batch["scores"], batch["response_mask"]) - beta * kl
        torch.testing.assert_close(batch["token_level_rewards"], expected, atol=1e-5, rtol=1e-5)
        seq_kl = float(((kl.sum(-1) / mask.sum(-1))).mean())
        assert m["actor/reward_kl_coef"] == pytest.approx(beta, rel=1e-9)
        assert m["actor/reward_kl_penalty"] == pytest.approx(seq_kl, abs=1e-5)
        beta *= 1 + min(max(seq_kl / 0.01 - 1, -0.2), 0.2) * n / 40
    assert runner.ppo.kl_ctrl.value == pytest.approx(beta, rel=1e-6)
    assert runner.ppo.kl_ctrl.value != pytest.approx(0.05, rel=1e-3)  # it did move


def test_recomputed_old_log_probs_come_from_the_trainer_and_report_the_rollout_mismatch(tiny, groups, tmp_path):
    """actor.recompute_log_prob: the old log-probs are a training forward of the current weights (not
    the rollout's), and the mismatch metrics are computed from the two."""
    _, tok, _ = tiny
    runner = runner_for(config("grpo", actor={"recompute_log_prob": True}), tiny, groups, seed=5)
    runner.save(str(tmp_path / "now"))  # the weights the step's rollout and old log-probs use
    m = runner.step(0)
    batch = runner.last_batch
    mask = batch["response_mask"].bool()
    expected = plain_log_probs(load_causal_lm(tmp_path / "now"), batch)
    torch.testing.assert_close(batch["old_log_probs"][mask], expected[mask], atol=1e-5, rtol=1e-5)
    diff = (batch["old_log_probs"] - batch["rollout_log_probs"])[mask].abs()
    assert m["rollout/logprob_abs_diff_mean"] == pytest.approx(float(diff.mean()), abs=1e-9)
    assert m["rollout/logprob_abs_diff_max"] == pytest.approx(float(diff.max()), abs=1e-9)
    assert 0 <= m["rollout/logprob_abs_diff_max"] < 1e-4  # same weights, same dtype: rounding only



def test_without_a_recompute_the_update_reports_the_rollout_mismatch_of_its_first_mini_batch(tiny, groups, tmp_path):
    """actor.recompute_log_prob off: the old log-probs are the rollout's, and the update's first forward
    (one mini-batch = the whole step here, before the optimizer step) gives the mismatch metrics: those
    of the rollout's log-probs against a plain forward of the weights the rollout sampled with."""
    runner = runner_for(config("grpo", actor={"ppo_mini_batch_size": 4}), tiny, groups, seed=5)
    runner.save(str(tmp_path / "now"))
    m = runner.step(0)
    batch = runner.last_batch
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    mask = batch["response_mask"].bool()
    trainer = plain_log_probs(load_causal_lm(tmp_path / "now"), batch)
    diff = (trainer - batch["rollout_log_probs"])[mask].abs()
    assert m["rollout/logprob_abs_diff_mean"] == pytest.approx(float(diff.mean()), abs=2e-6)
    assert m["rollout/logprob_abs_diff_max"] == pytest.approx(float(diff.max()), abs=2e-6)
    assert 0 <= m["rollout/logprob_k3_kl"] < 1e-8
    assert 0 < m["rollout/logprob_abs_diff_max"] < 1e-4  # two different computations: rounding only


def test_log_samples_keeps_that_many_rows_of_each_step_and_the_rollouts_file_holds_them(tiny, groups, tmp_path):
    _, tok, _ = tiny
    runner = runner_for(config("grpo", ppo={"log_samples": 3}), tiny, groups, seed=6)
    rollouts = RolloutsFile(tmp_path / "rollouts.parquet")  # what run_ppo_round rewrites after every step
    for step in range(2):
        runner.step(step)
        rollouts.update(runner.samples)
        assert len(read_rollouts(tmp_path / "rollouts.parquet")) == 3 * (step + 1)
    assert [r["step"] for r in runner.samples] == [0, 0, 0, 1, 1, 1]
    last = runner.last_batch
    texts = decode_responses(tok, last["responses"], last["response_mask"])
    for row in runner.samples[3:]:
        i = texts.index(row["response"])  # a response of that step's batch ...
        assert row["acc"] == pytest.approx(hash_reward(row["response"], "0"))  # ... scored by the reward function
        assert row["reward"] == pytest.approx(float(last["scores"][i]))
        assert row["response_length"] == int(last["response_mask"][i].sum())
        assert row["prompt"] in {f"{k}+{k}" for k in range(8)}
    df = read_rollouts(tmp_path / "rollouts.parquet")
    assert list(df.columns) == list(ROLLOUT_COLUMNS)
    assert df.to_dict("records") == runner.samples
    # one actor update per step: step 0 sampled the initial weights (version 0), step 1 those after one update
    assert df["policy_version"].tolist() == [0, 0, 0, 1, 1, 1] and runner.policy_version == 2
    assert runner_for(config("grpo", ppo={"log_samples": 0}), tiny, groups).samples == []


def test_the_critic_uses_its_own_batch_sizes():
    cfg = config("gae", actor={"ppo_mini_batch_size": 2, "micro_batch_size": 64},
                 critic={"ppo_mini_batch_size": 4, "micro_batch_size": 3})
    critic, actor = critic_update_spec(cfg, seed=0), actor_update_spec(cfg, seed=0)
    # 4 prompts x 4 responses over 2 ranks: 8 rows per rank per critic step, 4 per actor step
    assert (critic.mini_batch_size, critic.micro_batch_size) == (8, 3)
    assert (actor.mini_batch_size, actor.micro_batch_size) == (4, 64)
    defaulted = critic_update_spec(config("gae", actor={"ppo_mini_batch_size": 2}), seed=0)
    assert defaulted.mini_batch_size == 4  # null: the actor's mini-batch


def test_overlong_penalty_by_hand():
    # max_len 10, buffer 4: no penalty up to 6 tokens, then -(L-6)/4 * factor
    got = overlong_penalty(torch.tensor([5, 6, 8, 10]), 10, 4, 2.0)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -1.0, -2.0]))


def test_place_scores_on_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    got = place_scores(torch.tensor([2.0, -1.0, 0.5]), mask)
    assert torch.equal(got, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, -1.0], [0.5, 0.0, 0.0]]))


def test_keep_informative_groups_drops_uniform_groups():
    batch = Batch({"scores": torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), "id": torch.arange(6)})
    kept = keep_informative_groups(batch, 2)  # groups: [1,1] [0,1] [0,0] -> keep the middle one
    assert kept["id"].tolist() == [2, 3]


def test_validate_scores_each_prompt_whatever_the_batch_size(tiny, groups):
    """Greedy validation of 7 prompts (not divisible over 2 ranks: padded and trimmed) equals
    the mean of validating each prompt alone; the hash reward is nearly unique per response,
    so a response paired with the wrong prompt or a padded row counted would show."""
    _, _, prompts = tiny
    runner = runner_for(config("grpo"), tiny, groups, seed=3)
    seven = prompts.slice(0, 7)
    whole = runner.validate(seven)
    alone = [runner.validate(seven.slice(i, i + 1)) for i in range(7)]
    for key in ("val/greedy_pass@1", "val/response_length"):
        assert whole[key] == pytest.approx(sum(a[key] for a in alone) / 7, abs=1e-9), key


def test_non_finite_advantages_and_returns_on_one_rank_skip_every_update_step_on_both_ranks(tiny, groups, tmp_path):
    """Rank 1's half of a real step's batch gets an infinite advantage and a NaN return in every row: every
    optimizer step of the actor and of the critic is non-finite on rank 1 only, and both ranks skip it (the
    log-probs each rank computes for its half of the rows are exactly as before, and so are the critic's
    weights; the counts are means over the ranks, so each rank counted every step). The next real step
    trains both again."""
    runner = runner_for(config("gae"), tiny, groups, seed=4)
    runner.step(0)
    batch = runner.last_batch
    sequences_only = batch.only(*SEQUENCE_KEYS)

    def state(name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The actor's log-probs of the rows and the critic's weights (its values are not used: the value
        head's dropout makes them differ from call to call)."""
        runner.ppo.critic.call(CriticWorker.save, str(tmp_path / name))
        log_probs = runner.actor.call(ActorRolloutRefWorker.compute_log_prob, sequences_only, runner.ppo.log_prob_spec)
        return log_probs["old_log_probs"], weights(tmp_path / name)

    before = state("before")
    half = len(batch) // 2  # the rows rank 1 gets
    advantages, returns = batch["advantages"].clone(), batch["returns"].clone()
    advantages[half:], returns[half:] = math.inf, math.nan
    bad = Batch({**batch.tensors, "advantages": advantages, "returns": returns})
    actor = runner.actor.call(ActorRolloutRefWorker.update_actor, bad.only(*ACTOR_UPDATE_KEYS), runner.ppo.actor_spec)
    critic = runner.ppo.critic.call(CriticWorker.update_critic, bad.only(*CRITIC_UPDATE_KEYS), runner.ppo.critic_spec)
    steps = len(batch) // 2 // runner.ppo.actor_spec.mini_batch_size  # optimizer steps per update (rows per rank / mini)
    assert steps == 2 and actor["actor/nonfinite_steps"] == critic["critic/nonfinite_steps"] == steps
    after = state("after")
    assert torch.equal(after[0], before[0])
    assert all(torch.equal(after[1][k], v) for k, v in before[1].items())
    m = runner.step(1)
    assert m["actor/nonfinite_steps"] == m["critic/nonfinite_steps"] == 0
    trained = state("trained")
    assert not torch.equal(trained[0], before[0])
    assert any(not torch.equal(trained[1][k], v) for k, v in before[1].items())


def test_a_round_whose_advantages_turn_infinite_stops_after_max_nonfinite_steps(tiny, groups, tmp_path, monkeypatch):
    """The real round loop on this module's groups: from step 1 on the advantages are infinite and the returns
    NaN, so every actor and critic optimizer step is skipped (2 per PPO step). With actor.max_nonfinite_steps 3
    the round stops at step 2 (4 in a row), naming step 0's metrics; the plot holds steps 0 to 2."""
    folder, tok, _ = tiny
    data = tmp_path / "rl.parquet"
    write_rows(rows(HASH_SOURCE).to_dict("records"), data)
    real = ppo_step.compute_advantage
    calls = []

    def turning_infinite(*args, **kwargs):
        adv, ret = real(*args, **kwargs)
        calls.append(adv)
        return (adv, ret) if len(calls) == 1 else (torch.full_like(adv, math.inf), torch.full_like(ret, math.nan))

    @contextmanager
    def on_this_modules_groups(cfg, pool, *, init_dir, tokenizer, prompts, seed, steps=None):
        yield sync_round_runner(cfg, groups, tokenizer=tokenizer, prompts=prompts, seed=seed)

    monkeypatch.setattr(ppo_step, "compute_advantage", turning_infinite)
    reuse_the_module_groups(monkeypatch, on_this_modules_groups)
    cfg = config("gae", actor={"max_nonfinite_steps": 3},
                 ppo={"rounds": {"r1": {"init": str(folder), "steps": 6}}, "val_every": 0, "log_samples": 0})
    plot = tmp_path / "plot.csv"
    with pytest.raises(TrainingDiverged) as info:
        ppo.run_ppo_round(cfg, round_name="r1", init_dir=str(folder), tokenizer=tok, data_path=str(data),
                          out_dir=str(tmp_path / "out"), tracker=NullTracker(), plot_csv=str(plot))
    logged = list(csv.DictReader(plot.open()))
    assert [float(r["actor/nonfinite_steps"]) for r in logged] == [0, 2, 2]
    assert [float(r["critic/nonfinite_steps"]) for r in logged] == [0, 2, 2]
    first = logged[0]
    assert str(info.value) == (
        "step 2: 4 consecutive optimizer steps skipped for a non-finite loss or gradient norm "
        f"(actor.max_nonfinite_steps: 3; last finite at step 0: actor/pg_loss={float(first['actor/pg_loss']):.4g}, "
        f"actor/grad_norm={float(first['actor/grad_norm']):.4g}); lower actor.lr or check the rewards")


def test_a_step_gives_samples_whose_reward_function_raises_the_error_score_and_counts_them(tiny, groups):
    _, tok, _ = tiny
    RULES.register("test_flaky")(flaky_reward)
    try:
        runner = runner_for(config("grpo", reward={"error_score": -0.5}), tiny, groups, seed=6,
                            prompts=prompt_batch(rows("test_flaky"), tok, 16, "flaky rows"))
        m = runner.step(0)
    finally:
        RULES._items.pop("test_flaky")
    texts = decode_responses(tok, runner.last_batch["responses"], runner.last_batch["response_mask"])
    failing = [zlib.crc32(t.encode()) % 4 == 0 for t in texts]
    assert 0 < sum(failing) < len(texts)
    assert (m["reward/errors"], m["reward/timeouts"]) == (sum(failing), 0)
    expected = [-0.5 if bad else hash_reward(t, "0") for t, bad in zip(texts, failing)]
    assert m["rollout/acc"] == pytest.approx(np.mean(expected), abs=1e-6)


def test_ctrl_c_mid_step_finishes_the_step_checkpoints_it_and_stops(tiny, groups, tmp_path, monkeypatch):
    """A SIGINT arriving during step 0 of the real round loop: the step completes, a step-1 checkpoint with
    the actor's and the critic's state and the controller's rows is written (although save_every would not
    have saved yet), then KeyboardInterrupt; a second signal inside a loop stops at once."""
    import signal

    from rlcore.interrupt import STOP, on_signal, training_loop
    from rlcore.trainer.loop.checkpoint import CONTROLLER_FILE, StepCheckpoints

    folder, tok, _ = tiny
    data = tmp_path / "rl.parquet"
    write_rows(rows(HASH_SOURCE).to_dict("records"), data)

    @contextmanager
    def on_this_modules_groups(cfg, pool, *, init_dir, tokenizer, prompts, seed, steps=None):
        runner = sync_round_runner(cfg, groups, tokenizer=tokenizer, prompts=prompts, seed=seed)
        real_step = runner.step

        def interrupted_step(step):
            on_signal(signal.SIGINT, None)  # Ctrl-C while the workers compute
            return real_step(step)

        runner.step = interrupted_step
        yield runner

    reuse_the_module_groups(monkeypatch, on_this_modules_groups)
    cfg = config("gae", ppo={"rounds": {"r1": {"init": str(folder), "steps": 6}}, "val_every": 0, "log_samples": 0})
    ck = StepCheckpoints(tmp_path / "ckpt", stage="ppo@r1", save_every=5, keep_last=0, fingerprint={})
    plot = tmp_path / "plot.csv"
    with pytest.raises(KeyboardInterrupt):
        ppo.run_ppo_round(cfg, round_name="r1", init_dir=str(folder), tokenizer=tok, data_path=str(data),
                          out_dir=str(tmp_path / "out"), tracker=NullTracker(), plot_csv=str(plot), checkpoints=ck)
    assert len(list(csv.DictReader(plot.open()))) == 1  # step 0 finished and was logged, step 1 never started
    [(step, saved)] = ck.complete()
    assert step == 1
    assert {p.name for p in saved.iterdir()} >= {CONTROLLER_FILE, "actor.pt", "critic.pt", "actor.rng0.pt",
                                                 "actor.rng1.pt"}
    state = torch.load(saved / CONTROLLER_FILE, weights_only=False)
    assert [r["step"] for r in state["log_rows"]] == [0] and state["ppo"]["policy_version"] == 1
    assert not (tmp_path / "out").exists()

    # `rlcore export` of that checkpoint: the weights the actor holds now (no step ran after it), as saved by
    # the workers' own save_pretrained, give the same logits
    from transformers import AutoModelForCausalLM

    from rlcore.commands import main

    groups.actor.call(ActorRolloutRefWorker.save, str(tmp_path / "saved"))
    assert main(["export", "--model", str(saved), "--out", str(tmp_path / "exported")]) == 0
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))(ids).logits
        b = AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"))(ids).logits
    assert torch.equal(a, b)

    with training_loop():
        on_signal(signal.SIGTERM, None)
        with pytest.raises(KeyboardInterrupt):
            on_signal(signal.SIGTERM, None)
    assert not STOP.armed and not STOP.requested


# --- writes that fail for real: a model folder that cannot be written, a full disk ---------------------------------


@contextmanager
def mounted_tmpfs(where, size_bytes: int, *, readonly: bool = False):
    """A tmpfs of ``size_bytes`` at ``where`` (mounted by this root process, so the Ray workers see it too),
    unmounted afterwards; the test is skipped where mounting is not permitted (not root, a container without
    CAP_SYS_ADMIN)."""
    import subprocess

    where.mkdir(parents=True, exist_ok=True)
    options = f"size={size_bytes}" + (",ro" if readonly else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({(proc.stderr or proc.stdout).strip()}): run as root to test "
                    "a real full disk / read-only filesystem")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def reuse_the_module_groups(monkeypatch, round_on_pool) -> None:
    """Have ``ppo.run_ppo_round`` run ``round_on_pool`` (a round over this module's worker groups) in a job that
    starts no pool of its own."""
    monkeypatch.setattr(job, "start_pool", lambda cfg: nullcontext())
    monkeypatch.setattr(ppo, "round_on_pool", round_on_pool)


def round_in(tmp_path, groups, monkeypatch, steps: int, save_every: int, out_dir, checkpoints, init):
    """``ppo.run_ppo_round`` of this module's groups (started from ``init``) over the hash-reward rows."""
    from rlcore.tracking import NullTracker

    @contextmanager
    def on_this_modules_groups(cfg, pool, *, init_dir, tokenizer, prompts, seed, steps=None):
        yield sync_round_runner(cfg, groups, tokenizer=tokenizer, prompts=prompts, seed=seed)

    reuse_the_module_groups(monkeypatch, on_this_modules_groups)
    data = tmp_path / "rl.parquet"
    write_rows(rows(HASH_SOURCE).to_dict("records"), data)
    cfg = config("gae", ppo={"rounds": {"r1": {"init": str(init), "steps": steps}}, "val_every": 0, "log_samples": 2,
                             "save_every": save_every})
    return lambda tok: ppo.run_ppo_round(cfg, round_name="r1", init_dir=str(init), tokenizer=tok, data_path=str(data),
                                         out_dir=str(out_dir), tracker=NullTracker(),
                                         plot_csv=str(tmp_path / "plot.csv"),
                                         rollouts_path=str(tmp_path / "rollouts.parquet"), checkpoints=checkpoints)


@pytest.mark.parametrize("fault", ["a file in the way", "a read-only filesystem"])
def test_a_rounds_model_folder_that_cannot_be_written_is_one_error_and_keeps_the_checkpoints_and_plots(
        tiny, groups, tmp_path, monkeypatch, fault):
    """The workers' own save of the round's model fails for real (rank 0's mkdir under a file; a tmpfs mounted
    read-only): one UserError naming the folder and the reason (exit code 2), the step checkpoint, the plot rows
    and the rollouts written so far intact, and the checkpoint resumable."""
    from rlcore.errors import UserError
    from rlcore.trainer.loop.checkpoint import StepCheckpoints
    from rlcore.viewer import read_rollouts

    _, tok, _ = tiny
    ck = StepCheckpoints(tmp_path / "ckpt", stage="ppo@r1", save_every=1, keep_last=0, fingerprint={})
    if fault == "a file in the way":
        (tmp_path / "blocker").write_text("a file where the models folder should be")
        out, reason, context = tmp_path / "blocker" / "r1", "Not a directory", nullcontext()
    else:
        out, reason = tmp_path / "ro" / "r1", "Read-only file system"
        context = mounted_tmpfs(tmp_path / "ro", 1 << 20, readonly=True)
    with context:
        with pytest.raises(UserError) as raised:
            round_in(tmp_path, groups, monkeypatch, steps=2, save_every=1, out_dir=out, checkpoints=ck,
                     init=tiny[0])(tok)
    assert str(raised.value) == (f"cannot write the round's model to {out}: {reason} (the step checkpoints and the "
                                 "metrics and plots so far are intact)")
    assert [int(r["step"]) for r in csv.DictReader((tmp_path / "plot.csv").open())] == [0, 1]
    assert read_rollouts(tmp_path / "rollouts.parquet")["step"].tolist() == [0, 0, 1, 1]
    resume = StepCheckpoints(tmp_path / "ckpt", stage="ppo@r1", save_every=1, keep_last=0, fingerprint={}).resume()
    assert resume is not None and resume.step == 1


def test_a_full_disk_while_writing_a_step_checkpoint_is_one_error_and_the_previous_checkpoint_stays(
        tiny, groups, tmp_path, monkeypatch):
    """A real full disk: the checkpoints go to a tmpfs with room for one checkpoint and a half, so the workers'
    write of the second runs out of space (ENOSPC from the kernel, through Ray). One error names the folder being
    written; that partial folder is removed, the first checkpoint is intact (its files as written) and is what a
    re-run resumes from."""
    from rlcore.trainer.loop.checkpoint import CheckpointWriteError, StepCheckpoints

    _, tok, _ = tiny
    probe = tmp_path / "probe"
    probe.mkdir()
    runner_for(config("gae"), tiny, groups).save_state(probe)  # the workers' files of one checkpoint, measured
    one = sum(f.stat().st_size for f in probe.iterdir())
    assert one > 128 * 1024, one  # so that 1.5 checkpoints + 64 KiB hold one and not two
    size = ((3 * one // 2 + 64 * 1024) // 4096 + 1) * 4096
    with mounted_tmpfs(tmp_path / "disk", size) as disk:
        ck = StepCheckpoints(disk / "ppo@r1", stage="ppo@r1", save_every=1, keep_last=0, fingerprint={})
        with pytest.raises(CheckpointWriteError) as raised:
            round_in(tmp_path, groups, monkeypatch, steps=3, save_every=1, out_dir=tmp_path / "out",
                     checkpoints=ck, init=tiny[0])(tok)
        message = str(raised.value)
        assert message.startswith(f"ppo@r1: cannot write checkpoint {disk / 'ppo@r1' / 'step_00000002'}")
        assert "No space left" in message and message.endswith("(the previous checkpoint is intact)")
        assert sorted(p.name for p in (disk / "ppo@r1").iterdir()) == ["step_00000001"]  # the partial one is gone
        again = StepCheckpoints(disk / "ppo@r1", stage="ppo@r1", save_every=1, keep_last=0, fingerprint={})
        resume = again.resume()  # checks every file against the sizes recorded when it was written
        assert resume is not None and resume.step == 1 and len(resume.state["log_rows"]) == 1
    assert [int(r["step"]) for r in csv.DictReader((tmp_path / "plot.csv").open())] == [0, 1]
    assert not (tmp_path / "out").exists()
