"""Every registered estimator (and the DAPO tricks) runs real PPO steps on Ray workers.

A hash-of-the-text reward gives every group a spread of rewards from a random tiny
model, so each estimator produces non-zero advantages and the policy must change.
One actor/rollout/ref group and one critic group serve every estimator (starting
worker processes is what costs time here).
"""

from __future__ import annotations

import math
import zlib

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from rlcore.algos.advantage import ESTIMATORS
from rlcore.config import parse_config
from rlcore.data.collate import prompt_batch
from rlcore.engine.model import load_tokenizer
from rlcore.engine.tiny_model import materialize_tiny
from rlcore.rewards.rule import REWARD_FNS
from rlcore.trainer.common import actor_group, critic_group, start_pool
from rlcore.trainer.ppo import RoundRunner, keep_informative_groups, overlong_penalty, place_scores
from rlcore.protocol import Batch

LENGTH_SOURCE = "test_hash"


@pytest.fixture(scope="module", autouse=True)
def hash_reward():
    """A deterministic, almost tie-free reward of the text (every group has a spread),
    registered only while this module runs so other tests see the real registry."""
    REWARD_FNS.register(LENGTH_SOURCE)(lambda text, gt: (zlib.crc32(text.encode()) % 1000) / 1000)
    yield
    REWARD_FNS._items.pop(LENGTH_SOURCE)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = materialize_tiny(tmp_path_factory.mktemp("tiny"), seed=0, arch="llama", hidden_size=32, num_layers=1,
                              num_heads=2, intermediate_size=64, max_position_embeddings=64)
    tok = load_tokenizer(folder)
    rows = [{"data_source": LENGTH_SOURCE, "prompt": [{"role": "user", "content": f"{i}+{i}"}], "ability": "t",
             "reward_model": {"style": "rule", "ground_truth": "0"},
             "extra_info": {"split": "rl", "index": i, "question": f"{i}+{i}", "answer": ""}} for i in range(8)]
    return folder, tok, prompt_batch(pd.DataFrame(rows), tok, 16, "test rows")


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
    folder = tiny[0]
    cfg = config("gae")
    pool = start_pool(cfg)
    actor = actor_group(cfg, pool, folder, ("actor", "rollout", "ref"), optim={"lr": 0.01, "weight_decay": 0.0,
                                                                             "warmup_steps": 0}, share=2)
    critic = critic_group(cfg, pool, folder, share=2)
    yield actor, critic
    actor.shutdown()
    critic.shutdown()
    pool.release()


@pytest.mark.parametrize("estimator", ESTIMATORS.names())
def test_estimator_trains_the_policy(estimator, tiny, groups, tmp_path):
    folder, tok, prompts = tiny
    groups[0].save(str(tmp_path / "before"))
    runner = RoundRunner(config(estimator), init_dir=str(folder), tokenizer=tok, prompts=prompts, seed=1,
                         groups=groups)
    metrics = [runner.step(i) for i in range(2)]
    runner.save(str(tmp_path / "after"))
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values()), m
        assert 0.0 <= m["rollout/acc"] <= 1.0
        assert ("critic/vf_loss" in m) == (estimator == "gae")
    before, after = weights(tmp_path / "before"), weights(tmp_path / "after")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before), "policy weights did not change"
    assert (tmp_path / "after" / "critic").is_dir() == (estimator == "gae")


def test_dapo_dynamic_sampling_and_overlong(tiny, groups):
    folder, tok, prompts = tiny
    cfg = config("grpo", ppo={"dapo": {"dynamic_sampling": True, "max_sample_tries": 3, "overlong_buffer": 2}},
                 actor={"use_kl_loss": False})
    runner = RoundRunner(cfg, init_dir=str(folder), tokenizer=tok, prompts=prompts, seed=2,
                         groups=groups)
    m = runner.step(0)
    assert m["rollout/sample_tries"] in (1, 2, 3)
    assert m["rollout/groups_kept"] == 4  # the hash reward leaves no group uniform
    assert "actor/kl_ref" not in m  # no KL term: the reference is not consulted


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
    folder, tok, prompts = tiny
    runner = RoundRunner(config("grpo"), init_dir=str(folder), tokenizer=tok, prompts=prompts, seed=3, groups=groups)
    seven = prompts.slice(0, 7)
    whole = runner.validate(seven)
    alone = [runner.validate(seven.slice(i, i + 1)) for i in range(7)]
    for key in ("val/greedy_pass@1", "val/response_length"):
        assert whole[key] == pytest.approx(sum(a[key] for a in alone) / 7, abs=1e-9), key
