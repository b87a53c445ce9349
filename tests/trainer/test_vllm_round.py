"""PPO rounds with vLLM generating (rollout.engine: vllm), on Ray workers, with vLLM's CPU build.

Sync: a GRPO round on a reward the tiny random model's samples spread on (the share of one character in the
response) learns it within a few steps; every step's weights reach vLLM in memory, and the weight-sync check after
each update passes (it raises otherwise); vLLM's log-probs of its sampled tokens agree with the trainer's recomputed
ones (the mismatch metric). Async: a generator worker with its own vLLM engine takes the versioned weights from the
object store, checks them, and the round trains. The openai loop: an agent program's two-turn conversations, served
by vLLM a whole turn per engine call, rewarded by the agent itself, learn the same reward, and the trainer's
log-probs of the recorded rows are vLLM's (the rows hold exactly the sampled tokens). Runs where vLLM is installed
(`make test-vllm`, CI).
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest

from rlcore.config import parse_config
from rlcore.data.collate import prompt_batch
from rlcore.engine.model import load_tokenizer
from rlcore.engine.tiny_model import materialize_tiny
from rlcore.rewards.rule import RULES
from rlcore.trainer.round.modes import running_async_round
from rlcore.trainer.loop.pool import start_pool
from rlcore.trainer.round.worker_groups import RoundWorkerGroups
from rlcore.trainer.round.modes import sync_round_runner

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test-vllm)")]
SOURCE = "test_vllm_share"


def share_of_a(text: str, ground_truth: str) -> float:
    """The share of 'a' among the response's characters: learnable from a random model, token by token."""
    return text.count("a") / max(len(text), 1)


@pytest.fixture(scope="module", autouse=True)
def reward():
    RULES.register(SOURCE)(share_of_a)
    yield
    RULES._items.pop(SOURCE)


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A random tiny Llama with head_dim 32 (one head of 32), its tokenizer and 8 prompts."""
    folder = materialize_tiny(tmp_path_factory.mktemp("policy"), seed=0, arch="llama", hidden_size=32, num_layers=1,
                              num_heads=1, intermediate_size=64, max_position_embeddings=64)
    rows = pd.DataFrame([{"data_source": SOURCE, "prompt": [{"role": "user", "content": f"{i}+{i}"}], "ability": "t",
                          "reward_model": {"style": "rule", "ground_truth": "0"},
                          "extra_info": {"split": "rl", "index": i, "question": f"{i}+{i}", "answer": ""}}
                         for i in range(8)])
    return folder, load_tokenizer(folder), rows


def config(mode: str, agent: dict | None = None, max_response_length: int = 8):
    return parse_config({
        "ray": {"num_cpus": 2}, "tracking": {"enabled": False},
        "model": {"tiny": {"hidden_size": 32, "num_heads": 1}},
        "resources": {"n_workers": 1, "cpus_per_worker": 1},
        "task": {"max_response_length": max_response_length},
        "rollout": {"engine": "vllm", "n": 4, "n_workers": 1, "kv_cache_gib": 0.125, "agent": agent or {}},
        "algorithm": {"adv_estimator": "grpo"},
        "actor": {"ppo_mini_batch_size": 8, "lr": 0.02, "use_kl_loss": False,
                  "recompute_log_prob": mode == "sync"},
        "ppo": {"train_batch_size": 8, "mode": mode, "async": {"max_staleness": 0, "queue_size": 1}}})


@contextmanager
def worker_groups(cfg, folder):
    with start_pool(cfg) as pool:
        groups = RoundWorkerGroups.start(cfg, pool, str(folder))
        try:
            yield groups
        finally:
            groups.shutdown()


def test_a_sync_round_learns_with_vllm_generating_and_every_sync_checked(policy, ray_local):
    folder, tok, rows = policy
    cfg = config("sync")
    with worker_groups(cfg, folder) as groups:
        runner = sync_round_runner(cfg, groups, tokenizer=tok, prompts=prompt_batch(rows, tok, 64, "rows"), seed=0)
        metrics = [runner.step(s) for s in range(12)]
    rewards = [m["rollout/reward_mean"] for m in metrics]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print("rewards", [round(r, 3) for r in rewards])
    assert last > first + 0.1, rewards
    # vLLM's log-probs of what it sampled are the trainer's own (same weights, float32, other kernels)
    assert max(m["rollout/logprob_abs_diff_max"] for m in metrics) < 1e-3


def test_an_agent_program_served_by_vllm_learns_its_own_reward(policy, ray_local):
    folder, tok, rows = policy
    agent = {"loop": "openai", "agents": [{"path": str(Path(__file__).parent / "vllm_agent" / "agent.py")}],
             "processes": 1, "max_turns": 2}
    cfg = config("sync", agent, max_response_length=24)
    with worker_groups(cfg, folder) as groups:
        runner = sync_round_runner(cfg, groups, tokenizer=tok, prompts=prompt_batch(rows, tok, 64, "rows"), seed=0)
        metrics = [runner.step(s) for s in range(12)]
    rewards = [m["rollout/reward_mean"] for m in metrics]
    print("agent rewards", [round(r, 3) for r in rewards])
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards
    assert all(m["agent/requests"] == 2 and m["agent/split"] == 0 and m["agent/failures"] == 0 for m in metrics)
    assert max(m["rollout/logprob_abs_diff_max"] for m in metrics) < 1e-3


def test_an_async_round_trains_on_a_vllm_generator(policy, ray_local):
    folder, tok, rows = policy
    cfg = config("async")
    with worker_groups(cfg, folder) as groups, running_async_round(
            cfg, groups, init_dir=str(folder), tokenizer=tok, prompts=prompt_batch(rows, tok, 64, "rows"), seed=0,
            steps=3) as runner:
        metrics = [runner.step(s) for s in range(3)]
    # max_staleness 0: each step trained on rollouts of the weights of the step before, which the generator's
    # vLLM engine took (and checked) between the steps
    assert all(m["async/staleness"] == 0 for m in metrics)
    assert all(m["async/generators"] == 1 and m["async/generator_deaths"] == 0 for m in metrics)
    assert all(0.0 <= m["rollout/reward_mean"] <= 1.0 for m in metrics)
