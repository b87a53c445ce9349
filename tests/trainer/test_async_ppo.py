"""Asynchronous rounds on real Ray workers: staleness, off-policy weights, generators that die, clean shutdown.

One trainer group serves every test (two ranks of half a CPU, so a generator fits beside them on the
session's two CPUs); each test starts its own generators. That max_staleness 0 reproduces the synchronous
round step for step is checked on the real pipeline (``tests/test_e2e_pipeline.py``).
"""

from __future__ import annotations

import os
import signal

import pandas as pd
import pytest
import ray
import torch
from ray.util.placement_group import placement_group_table

from rlcore.config import parse_config
from rlcore.data.collate import prompt_batch
from rlcore.engine.model import load_tokenizer
from rlcore.engine.tiny_model import materialize_tiny
from rlcore.errors import WorkerDied
from rlcore.rewards.rule import REWARD_FNS
from rlcore.trainer.async_ppo import AsyncRoundRunner, running_async_round
from rlcore.trainer.common import start_pool
from rlcore.trainer.ppo import RoundGroups
from tests.trainer.reward_fns import hash_reward

SOURCE = "test_async_hash"


@pytest.fixture(scope="module", autouse=True)
def test_reward():
    REWARD_FNS.register(SOURCE)(hash_reward)
    yield
    REWARD_FNS._items.pop(SOURCE)


def config(**over):
    raw = {"ray": {"num_cpus": 2}, "tracking": {"enabled": False},
           "resources": {"n_workers": 2, "cpus_per_worker": 0.5}, "rollout": {"n": 4, "n_workers": 1},
           "task": {"max_response_length": 5}, "algorithm": {"adv_estimator": "grpo"},
           "actor": {"ppo_mini_batch_size": 2, "lr": 0.01}, "ppo": {"train_batch_size": 4, "mode": "async"}}
    for k, v in over.items():
        raw.setdefault(k, {}).update(v)
    return parse_config(raw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = materialize_tiny(tmp_path_factory.mktemp("tiny"), seed=0, arch="llama", hidden_size=32, num_layers=1,
                              num_heads=2, intermediate_size=64, max_position_embeddings=64)
    tok = load_tokenizer(folder)
    rows = pd.DataFrame([{"data_source": SOURCE, "prompt": [{"role": "user", "content": f"{i}+{i}"}], "ability": "t",
                          "reward_model": {"style": "rule", "ground_truth": "0"},
                          "extra_info": {"split": "rl", "index": i, "question": f"{i}+{i}", "answer": ""}}
                         for i in range(8)])
    return str(folder), tok, prompt_batch(rows, tok, 16, "test rows")


@pytest.fixture(scope="module")
def groups(tiny):
    cfg = config()
    with start_pool(cfg) as pool:
        groups = RoundGroups.start(cfg, pool, tiny[0])
        yield groups
        groups.shutdown()


def async_round(cfg, tiny, groups, steps: int):
    folder, tok, prompts = tiny
    return running_async_round(cfg, groups, init_dir=folder, tokenizer=tok, prompts=prompts, seed=3, steps=steps)


def gone(handle) -> bool:
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=30)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_stale_batches_are_corrected_a_killed_generator_is_restarted_and_nothing_is_left(tiny, groups):
    """max_staleness 1 with one generator: after the first step every batch was generated one version back (the
    generator works on the next batch while the trainer trains), the trainer recomputes the proximal log-probs,
    and the advantages are the estimator's times min(pi_prox / pi_behav, cap). The generator, SIGKILLed mid-round,
    is restarted and the round completes; afterwards no actor, queue or placement group is left. The controller
    takes and scores each next batch while the update runs, as it does on GPUs."""
    cfg = config(ppo={"train_batch_size": 4, "mode": "async", "async": {"max_staleness": 1}},
                 actor={"ppo_mini_batch_size": 2, "lr": 0.05, "off_policy": {"correction": "tis", "cap": 1.02}})
    with async_round(cfg, tiny, groups, steps=6) as runner:
        runner.prefetch = True  # what a GPU run does: the next batch taken and scored while the update runs
        rows = [runner.step(i) for i in range(3)]
        (pid,) = runner.gens.pids()
        os.kill(pid, signal.SIGKILL)  # mid-round: it holds the next batch (generated or being generated)
        rows += [runner.step(i) for i in range(3, 6)]
        batch = runner.last_batch
        handles = [s.actor for s in runner.gens.slots] + [runner.gens.weights, runner.gens.queue.queue.actor]
        pg = runner.gens.pg
        (new_pid,) = runner.gens.pids()
    assert [r["async/staleness_max"] for r in rows[:3]] == [0, 1, 1]
    assert all(r["async/staleness_max"] <= 1 and r["async/dropped_samples"] == 0 for r in rows)
    assert [s["policy_version"] for s in runner.samples][-1] == 6 - 1 - rows[-1]["async/staleness_max"]
    mask = batch["response_mask"].bool()
    ratio = (batch["old_log_probs"] - batch["rollout_log_probs"]).exp()
    expected = torch.where(mask, ratio.clamp(max=1.02), torch.zeros(()))
    torch.testing.assert_close(batch["is_weights"], expected, rtol=1e-6, atol=1e-7)
    assert rows[-1]["off_policy/ratio_max"] == pytest.approx(float(ratio[mask].max()), rel=1e-6)
    assert rows[-1]["off_policy/is_weight_max"] == pytest.approx(min(float(ratio[mask].max()), 1.02), rel=1e-6)
    if rows[-1]["async/staleness_max"] == 1:
        assert float(ratio[mask].max()) > 1.02, "one version of lr 0.05 should move some token past the cap"
    for key in ("async/trainer_idle_frac", "async/generator_idle_frac"):
        assert all(0 <= r[key] <= 1 for r in rows), key
    # the generator's death: counted once, a new process, every step trained on a full batch
    assert sum(r["async/generator_deaths"] for r in rows) == 1
    assert new_pid != pid
    assert all(r["rollout/groups_kept"] == 4 for r in rows) and runner.policy_version == 6
    # shutdown: generators, queue and version actor gone, placement group removed
    assert all(gone(h) for h in handles)
    assert placement_group_table(pg)["state"] == "REMOVED"


def test_without_restarts_the_round_goes_on_with_fewer_generators_and_stops_when_none_is_left(tiny, groups):
    cfg = config(resources={"n_workers": 2, "cpus_per_worker": 0.5},
                 rollout={"n": 4, "n_workers": 2, "cpus_per_worker": 0.5},
                 ppo={"train_batch_size": 4, "mode": "async", "async": {"max_staleness": 1,
                                                                         "max_generator_restarts": 0}})
    with async_round(cfg, tiny, groups, steps=6) as runner:
        runner.step(0)
        first, second = runner.gens.pids()
        os.kill(first, signal.SIGKILL)
        rows = [runner.step(i) for i in range(1, 4)]
        assert rows[-1]["async/generators"] == 1
        assert sum(r["async/generator_deaths"] for r in rows) == 1  # counted as a death handled
        os.kill(second, signal.SIGKILL)
        with pytest.raises(WorkerDied, match="generators.*no generator left"):
            for i in range(4, 6):
                runner.step(i)
    assert isinstance(runner, AsyncRoundRunner)


def test_the_proximal_policy_taken_from_the_update_trains_as_a_separate_forward_does(tiny, groups, tmp_path):
    """With one epoch of one mini-batch the update's first forward is the proximal policy, so the separate
    forward is skipped: the same step from the same state ends with the same weights and off-policy metrics."""
    from rlcore.trainer.ppo import RoundRunner

    _, tok, prompts = tiny
    cfg = config(actor={"ppo_mini_batch_size": 4, "lr": 0.05, "recompute_log_prob": True,
                        "off_policy": {"correction": "icepop", "low": 0.99, "high": 1.01}}, ppo={"train_batch_size": 4})
    runner = RoundRunner(cfg, groups=groups, tokenizer=tok, prompts=prompts, seed=9)
    state = runner.save_state(tmp_path)
    assert runner.proximal_in_update
    runner.step(0)
    runner.step(1)  # the rollout now ran version 1, the trainer is at version 1 too: ratios ~1
    fused = runner.step(2)
    runner.save(str(tmp_path / "fused"))
    runner.load_state(tmp_path, state)
    runner.proximal_in_update = False
    for i in range(2):
        runner.step(i)
    separate = runner.step(2)
    runner.save(str(tmp_path / "separate"))
    assert "timing_s/old_log_prob" in separate and "timing_s/old_log_prob" not in fused
    for key in ("off_policy/is_weight_mean", "off_policy/masked_token_frac", "off_policy/ratio_max", "rollout/acc"):
        assert fused[key] == pytest.approx(separate[key], abs=1e-5), key
    from safetensors.torch import load_file
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("fused", "separate"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)


def test_an_async_round_with_the_optimal_token_baseline_and_bypass_mode(tiny, groups):
    """The new estimators and losses in an asynchronous round with max_staleness 1: bypass_mode keeps the
    rollout's (stale) log-probs as the old policy, so nothing recomputes them, and the optimal token baseline's
    forward still brings sum pi^2 for the advantages. Its weights are taken against the current policy inside
    the loss: a stale batch moves them off 1."""
    cfg = config(algorithm={"adv_estimator": "optimal_token_baseline"},
                 actor={"ppo_mini_batch_size": 2, "lr": 0.05, "policy_loss": "bypass_mode",
                        "bypass": {"loss_type": "reinforce", "rollout_is": "token"}},
                 ppo={"train_batch_size": 4, "mode": "async", "async": {"max_staleness": 1}})
    with async_round(cfg, tiny, groups, steps=3) as runner:
        assert not runner.recompute_log_prob
        rows = [runner.step(i) for i in range(3)]
        batch = runner.last_batch
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    mask = batch["response_mask"].bool()
    assert "sum_pi_squared" in batch and bool((batch["sum_pi_squared"][mask] <= 1 + 1e-6).all())
    assert "off_policy/is_weight_mean" not in rows[-1]  # no actor.off_policy correction: bypass_mode's own
    assert rows[-1]["actor/is_weight_mean"] != pytest.approx(1.0, abs=1e-6)
