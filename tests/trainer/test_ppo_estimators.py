"""Real PPO steps on Ray workers: every registered estimator, and each config branch of a round.

A hash-of-the-text reward gives every group a spread of rewards from a random tiny model, so each
estimator produces non-zero advantages and the policy must change. One actor/rollout/ref group and
one critic group serve every test (starting worker processes is what costs time here). Each branch
test checks a value the branch changes against the same value worked out independently.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from rlcore.algos.advantage import ESTIMATORS
from rlcore.config import parse_config
from rlcore.data.collate import decode_responses, prompt_batch
from rlcore.engine.model import load_causal_lm, load_tokenizer
from rlcore.engine.sequence import sequences
from rlcore.engine.tiny_model import materialize_tiny
from rlcore.protocol import Batch
from rlcore.rewards.rule import REWARD_FNS
from rlcore.trainer.common import start_pool
from rlcore.trainer.ppo import RoundGroups, RoundRunner, actor_update_spec, critic_update_spec
from rlcore.trainer.rollout_data import keep_informative_groups, overlong_penalty, place_scores
from rlcore.viewer import ROLLOUT_COLUMNS, RolloutsFile, read_rollouts

HASH_SOURCE = "test_hash"
CONSTANT_SOURCE = "test_constant"


def hash_reward(text: str, gt: str) -> float:
    return (zlib.crc32(text.encode()) % 1000) / 1000


@pytest.fixture(scope="module", autouse=True)
def test_rewards():
    """A deterministic, almost tie-free reward of the text (every group has a spread) and a constant one,
    registered only while this module runs so other tests see the real registry."""
    REWARD_FNS.register(HASH_SOURCE)(hash_reward)
    REWARD_FNS.register(CONSTANT_SOURCE)(lambda text, gt: 1.0)
    yield
    for name in (HASH_SOURCE, CONSTANT_SOURCE):
        REWARD_FNS._items.pop(name)


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
        groups = RoundGroups.start(cfg, pool, str(tiny[0]))
        yield groups
        groups.shutdown()


def runner_for(cfg, tiny, groups, seed: int = 1, prompts: Batch | None = None) -> RoundRunner:
    _, tok, default = tiny
    return RoundRunner(cfg, groups=groups, tokenizer=tok, prompts=default if prompts is None else prompts, seed=seed)


def plain_log_probs(model, batch: Batch) -> torch.Tensor:
    """Log-probs of the responses under a plain Hugging Face forward, ``[rows, response_len]``."""
    ids, mask = sequences(batch)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    width = batch["responses"].shape[1]
    return F.log_softmax(logits[:, -width - 1:-1], -1).gather(-1, batch["responses"][..., None])[..., 0]


@pytest.mark.parametrize("estimator", ESTIMATORS.names())
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
    assert runner.kl_ctrl.value == pytest.approx(beta, rel=1e-6)
    assert runner.kl_ctrl.value != pytest.approx(0.05, rel=1e-3)  # it did move


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
