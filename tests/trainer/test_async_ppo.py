"""Asynchronous rounds on real Ray workers: staleness, off-policy weights, generators that die, clean shutdown.

One trainer group serves every test (two ranks of half a CPU, so a generator fits beside them on the
session's two CPUs); each test starts its own generators. That max_staleness 0 reproduces the synchronous
round step for step is checked on the real pipeline (``tests/test_e2e_pipeline.py``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pandas as pd
import pytest
import ray
import torch
import torch.nn.functional as F
from ray.util.placement_group import placement_group_table

from rlcore.config import parse_config
from rlcore.controller.generator_pool import BatchQueue, GeneratedBatch, GeneratorPool
from rlcore.data.collate import prompt_batch
from rlcore.engine.model import load_tokenizer
from rlcore.engine.tiny_model import materialize_tiny
from rlcore.errors import WorkerDied
from rlcore.protocol import Batch
from rlcore.rewards.rule import RULES
from rlcore.rollout import engine_spec
from rlcore.trainer.round.async_source import AsyncSource
from rlcore.trainer.round.modes import async_round_runner, running_async_round
from rlcore.trainer.loop.pool import start_pool
from rlcore.trainer.loop.model_specs import model_spec
from rlcore.trainer.round.worker_groups import RoundWorkerGroups
from rlcore.workers.proximal import FirstForwardLogProbs, RecomputedLogProbs, RolloutLogProbs
from tests.trainer import slow_generator
from tests.trainer.reward_fns import hash_reward

SOURCE = "test_async_hash"


@pytest.fixture(scope="module", autouse=True)
def test_reward():
    RULES.register(SOURCE)(hash_reward)
    yield
    RULES._items.pop(SOURCE)


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
        groups = RoundWorkerGroups.start(cfg, pool, tiny[0])
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


@torch.no_grad()
def plain_log_probs(folder, batch) -> torch.Tensor:
    """``[batch, response_len]`` log-probs of each row's response tokens under the Hugging Face model saved at
    ``folder``: one unpadded sequence at a time through ``AutoModelForCausalLM`` (not rlcore's forward), 0 at
    padding. The independent reference for the rollout's and the trainer's log-probs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = torch.zeros(batch["responses"].shape)
    for i in range(len(batch)):
        prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()]
        mask = batch["response_mask"][i].bool()
        response = batch["responses"][i][mask]
        logp = F.log_softmax(model(input_ids=torch.cat([prompt, response])[None]).logits[0].float(), -1)
        p = len(prompt)
        out[i, : len(response)] = logp[torch.arange(p - 1, p - 1 + len(response)), response]
    return out


@pytest.mark.integration
def test_stale_batches_are_corrected_a_killed_generator_is_restarted_and_nothing_is_left(tiny, groups, tmp_path):
    """max_staleness 1 with one generator: after the first step every batch was generated one version back (the
    generator works on the next batch while the trainer trains), the trainer recomputes the proximal log-probs,
    and each token's loss is weighted by min(pi_prox / pi_behav, cap). The generator, SIGKILLed mid-round,
    is restarted and the round completes; afterwards no actor, queue or placement group is left. The controller
    takes and scores each next batch while the update runs, as it does on GPUs.

    The reference is worked out apart from the round: the policy of every version is saved as a Hugging Face
    folder, and the last batch's log-probs are recomputed under each with a plain forward. The version whose
    log-probs are the rollout's is the one that generated the batch (so ``async/staleness`` must be the trained
    version minus it); the trained version's are the proximal ones; the weights are their clipped ratio."""
    cfg = config(ppo={"train_batch_size": 4, "mode": "async", "async": {"max_staleness": 1}},
                 actor={"ppo_mini_batch_size": 2, "lr": 0.05, "off_policy": {"correction": "tis", "cap": 1.02}})
    rows = []
    with async_round(cfg, tiny, groups, steps=6) as runner:
        runner.source.prefetch = True  # what a GPU run does: the next batch taken and scored while the update runs
        for i in range(6):
            runner.save(str(tmp_path / f"v{runner.policy_version}"))  # the weights of this version, before step i
            rows.append(runner.step(i))
            if i == 2:
                (pid,) = runner.source.gens.pids()
                os.kill(pid, signal.SIGKILL)  # mid-round: it holds the next batch (generated or being generated)
        batch = runner.last_batch
        handles = [s.actor for s in runner.source.gens.slots] + [runner.source.gens.weights, runner.source.gens.queue.queue.actor]
        pg = runner.source.gens.pg
        (new_pid,) = runner.source.gens.pids()
    assert [r["async/staleness"] for r in rows[:3]] == [0, 1, 1]
    assert all(r["async/staleness"] <= 1 and r["async/dropped_samples"] == 0 for r in rows)
    assert "async/staleness_mean" not in rows[0] and "rollout/sample_tries" not in rows[0]
    mask = batch["response_mask"].bool()
    by_version = {v: plain_log_probs(tmp_path / f"v{v}", batch) for v in range(6)}
    gaps = {v: float((lp - batch["rollout_log_probs"])[mask].abs().max()) for v, lp in by_version.items()}
    behaviour = min(gaps, key=gaps.get)
    assert gaps[behaviour] < 1e-4 and sorted(gaps.values())[1] > 1e-3, gaps  # one version, and only one, fits
    assert rows[-1]["async/staleness"] == 5 - behaviour
    assert [s["policy_version"] for s in runner.samples][-1] == behaviour
    torch.testing.assert_close(batch["old_log_probs"][mask], by_version[5][mask], rtol=0, atol=1e-4)
    ratio = (by_version[5] - by_version[behaviour]).exp()
    expected = ratio.clamp(max=1.02)[mask]  # the weights the update took against the rollout's log-probs
    assert rows[-1]["off_policy/is_weight_mean"] == pytest.approx(float(expected.mean()), abs=1e-4)
    assert rows[-1]["off_policy/is_weight_max"] == pytest.approx(float(expected.max()), abs=1e-4)
    assert rows[-1]["off_policy/ratio_max"] == pytest.approx(float(ratio[mask].max()), abs=1e-4)
    if behaviour < 5:
        assert float(ratio[mask].max()) > 1.02, "one version of lr 0.05 should move some token past the cap"
    # the generator's death: counted once, a new process, every step trained on a full batch
    assert sum(r["async/generator_deaths"] for r in rows) == 1
    assert new_pid != pid
    assert all(r["rollout/groups_kept"] == 4 for r in rows) and runner.policy_version == 6
    # shutdown: generators, queue and version actor gone, placement group removed
    assert all(gone(h) for h in handles)
    assert placement_group_table(pg)["state"] == "REMOVED"


@pytest.mark.integration
def test_idle_fractions_see_a_generator_that_takes_longer_than_the_update(tiny, groups, tmp_path, monkeypatch):
    """max_staleness 0 with a generator that sleeps a known 0.4 s per batch inside its busy time: the trainer
    waits at least that long every step (trainer_idle_frac x the step's wall time, measured here), and the
    generator's busy share of the steps adds up to at least 0.4 s a batch. (Started from a folder other than the
    one Ray started the node in: the generator works in the driver's, as the trainer's ranks do.)"""
    folder, tok, prompts = tiny
    cfg = config(ppo={"train_batch_size": 4, "mode": "async", "async": {"max_staleness": 0}})
    monkeypatch.chdir(tmp_path)
    gens = GeneratorPool(slow_generator.SlowGenerator, 1, 1.0, False, queue_size=1, max_restarts=0, timeout_s=60,
                         model=model_spec(cfg, folder), engine=engine_spec(cfg.rollout), shards=2, seed=cfg.seed)
    steps, delay = 4, slow_generator.DELAY_S
    try:
        assert ray.get(gens.slots[0].actor.__ray_call__.remote(lambda self: os.getcwd()), timeout=60) == str(tmp_path)
        runner = async_round_runner(cfg, groups, gens, tokenizer=tok, prompts=prompts, seed=3, steps=steps)
        rows, walls = [], []
        for i in range(steps):
            start = time.perf_counter()
            rows.append(runner.step(i))
            walls.append(time.perf_counter() - start)
    finally:
        gens.shutdown()
    for r, wall in zip(rows, walls):
        assert r["async/trainer_idle_frac"] * wall >= 0.9 * delay, (r["async/trainer_idle_frac"], wall)
    busy = sum((1 - r["async/generator_idle_frac"]) * r["timing_s/step"] for r in rows)
    # the first batch may be generated before step 0 starts (the runner starts the generators) and the last one's
    # busy time may land after the last step: the steps between hold at least the others' sleeps
    assert busy >= 0.9 * delay * (steps - 2), busy
    assert all(r["async/staleness"] == 0 for r in rows)


def test_queue_depth_counts_the_batch_the_controllers_get_already_took(ray_local):
    """The controller keeps a ``get`` outstanding on the queue actor: a batch it took out of the queue and has not
    handed over yet is still waiting, and the depth counts it."""
    queue = BatchQueue(4)
    try:
        assert queue.get(0.05) is None and queue.depth() == 0  # the get is now outstanding on an empty queue
        BatchQueue.put(queue.queue, "a")  # the outstanding get takes it at once: the queue is empty, it waits
        deadline = time.monotonic() + 30
        while queue.depth() != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (queue.queue.qsize(), queue.depth()) == (0, 1)
        BatchQueue.put(queue.queue, "b")
        assert queue.depth() == 2
        assert queue.get(5) == "a" and queue.depth() == 1
        assert queue.get(5) == "b" and queue.depth() == 0
    finally:
        queue.shutdown()


def test_a_batch_goes_through_the_queue_whole_and_the_queue_actor_never_loads_torch(ray_local):
    """The queue only passes batches on: it holds them as bytes, so its process never maps torch's library (an
    import of seconds of CPU per round), and the controller gets the generator's tensors back exactly."""
    class Verdict:  # no module can import it (as from a reward file loaded by path): plain pickle refuses it
        def __init__(self, score):
            self.score = score

    queue = BatchQueue(2)
    try:
        tensors = {"responses": torch.arange(12).reshape(3, 4), "rollout_log_probs": torch.randn(3, 4)}
        verdicts = [Verdict(0.5), Verdict(1.0), Verdict(0.0)]
        BatchQueue.put(queue.queue, GeneratedBatch(7, 3, Batch(dict(tensors), {"verdict": verdicts}), generator=1,
                                              gen_s=0.5))
        got = queue.get(30)
        assert (got.item_id, got.version, got.generator, got.gen_s) == (7, 3, 1, 0.5)
        for key, value in tensors.items():
            assert torch.equal(got.batch[key], value)
        assert [v.score for v in got.batch["verdict"]] == [0.5, 1.0, 0.0]
        pid = ray._private.state.actors(actor_id=queue.queue.actor._actor_id.hex())["Pid"]
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libc" in maps and "libtorch" not in maps
    finally:
        queue.shutdown()


@pytest.mark.integration
def test_a_resumed_round_generates_its_outstanding_batches_with_the_restored_weights(tiny, groups, tmp_path):
    """A round checkpointed after step 2 with max_staleness 0 has step 2's batch handed out and not trained on.
    Resumed on new generators, that batch must be generated with the restored version 2 (not the round's starting
    weights, which a generator holds until a version is published), so it is neither stale nor dropped, and its
    rollout log-probs are version 2's (worked out with a plain forward of the saved weights)."""
    cfg = config(ppo={"train_batch_size": 4, "mode": "async", "async": {"max_staleness": 0}})
    with async_round(cfg, tiny, groups, steps=4) as runner:
        runner.step(0)
        runner.step(1)
        state = runner.save_state(tmp_path)
        runner.save(str(tmp_path / "v2"))
        assert len(runner.source.outstanding) == 1
    with async_round(cfg, tiny, groups, steps=4) as resumed:
        resumed.load_state(tmp_path, state)
        row = resumed.step(2)
        batch = resumed.last_batch
    assert (row["async/staleness"], row["async/dropped_samples"]) == (0, 0)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(batch["rollout_log_probs"][mask], plain_log_probs(tmp_path / "v2", batch)[mask],
                               rtol=0, atol=1e-4)


@pytest.mark.integration
def test_without_restarts_the_round_goes_on_with_fewer_generators_and_stops_when_none_is_left(tiny, groups):
    cfg = config(resources={"n_workers": 2, "cpus_per_worker": 0.5},
                 rollout={"n": 4, "n_workers": 2, "cpus_per_worker": 0.5},
                 ppo={"train_batch_size": 4, "mode": "async", "async": {"max_staleness": 1,
                                                                         "max_generator_restarts": 0}})
    with async_round(cfg, tiny, groups, steps=6) as runner:
        runner.step(0)
        first, second = runner.source.gens.pids()
        os.kill(first, signal.SIGKILL)
        rows = [runner.step(i) for i in range(1, 4)]
        assert rows[-1]["async/generators"] == 1
        assert sum(r["async/generator_deaths"] for r in rows) == 1  # counted as a death handled
        os.kill(second, signal.SIGKILL)
        with pytest.raises(WorkerDied, match="generators.*no generator left"):
            for i in range(4, 6):
                runner.step(i)
    assert isinstance(runner.source, AsyncSource)


@pytest.mark.integration
def test_the_proximal_policy_taken_from_the_update_trains_as_a_separate_forward_does(tiny, groups, tmp_path):
    """With one epoch of one mini-batch the update's first forward is the proximal policy, so the separate
    forward is skipped: the same step from the same state ends with the same weights and off-policy metrics."""
    from rlcore.trainer.round.modes import sync_round_runner
    from rlcore.trainer.round.ppo_step import PPOStep

    _, tok, prompts = tiny
    cfg = config(actor={"ppo_mini_batch_size": 4, "lr": 0.05, "recompute_log_prob": True,
                        "off_policy": {"correction": "icepop", "low": 0.99, "high": 1.01}}, ppo={"train_batch_size": 4})
    runner = sync_round_runner(cfg, groups, tokenizer=tok, prompts=prompts, seed=9)
    state = runner.save_state(tmp_path)
    assert isinstance(runner.ppo.proximal, FirstForwardLogProbs)
    runner.step(0)
    runner.step(1)  # the rollout now ran version 1, the trainer is at version 1 too: ratios ~1
    fused = runner.step(2)
    runner.save(str(tmp_path / "fused"))
    runner.ppo = PPOStep(cfg, groups, seed=9, reward_weights=runner.scoring.weights, proximal=RecomputedLogProbs())
    runner.load_state(tmp_path, state)
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


@pytest.mark.integration
def test_an_async_round_with_the_optimal_token_baseline_and_bypass_mode(tiny, groups):
    """The new estimators and losses in an asynchronous round with max_staleness 1: bypass_mode keeps the
    rollout's (stale) log-probs as the old policy, so nothing recomputes them, and the optimal token baseline's
    forward still brings sum pi^2 for the advantages. Its weights are taken against the current policy inside
    the loss: a stale batch moves them off 1."""
    cfg = config(algorithm={"adv_estimator": "optimal_token_baseline"},
                 actor={"ppo_mini_batch_size": 2, "lr": 0.05,
                        "loss": {"name": "bypass_mode", "bypass_loss_type": "reinforce", "bypass_is": "token"}},
                 ppo={"train_batch_size": 4, "mode": "async", "async": {"max_staleness": 1}})
    with async_round(cfg, tiny, groups, steps=3) as runner:
        assert isinstance(runner.ppo.proximal, RolloutLogProbs)
        rows = [runner.step(i) for i in range(3)]
        batch = runner.last_batch
    assert [r["async/staleness"] for r in rows] == [0, 1, 1]
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    mask = batch["response_mask"].bool()
    assert "sum_pi_squared" in batch and bool((batch["sum_pi_squared"][mask] <= 1 + 1e-6).all())
    assert "off_policy/is_weight_mean" not in rows[-1]  # no actor.off_policy correction: bypass_mode's own
    assert rows[-1]["actor/is_weight_mean"] != pytest.approx(1.0, abs=1e-6)


def determined(row: dict) -> dict:
    """A step's metrics without what measures time and load."""
    timed = ("timing_s/", "perf/", "async/queue_depth", "async/trainer_idle_frac", "async/generator_idle_frac",
             "async/generation_s")
    return {k: v for k, v in row.items() if not k.startswith(timed)}


@pytest.mark.integration
def test_a_fixed_schedule_gives_the_same_bits_on_every_run_and_after_a_resume(tiny, groups, tmp_path):
    """ppo.async.schedule fixed with max_staleness 1 and two generators (which may finish out of order): batch k is
    generated by version max(0, k - 1) whatever the timing, so the round run again from the same state gives the same
    metrics and weights, and so does a round stopped after step 2's checkpoint and resumed on new generators. The
    checkpoint keeps batch 2, meant for version 1, which the resumed round (at version 2) could not generate again."""
    cfg = config(rollout={"n": 4, "n_workers": 2, "cpus_per_worker": 0.5},
                 ppo={"train_batch_size": 4, "mode": "async", "async": {"max_staleness": 1, "schedule": "fixed"}},
                 actor={"ppo_mini_batch_size": 2, "lr": 0.05, "off_policy": {"correction": "tis"}})

    def weights(runner, name: str) -> bytes:
        runner.save(str(tmp_path / name))
        return (tmp_path / name / "model.safetensors").read_bytes()

    (tmp_path / "start").mkdir()
    (tmp_path / "stopped").mkdir()
    with async_round(cfg, tiny, groups, steps=4) as runner:
        start = runner.save_state(tmp_path / "start")
        first = [runner.step(i) for i in range(4)]
        first_weights = weights(runner, "first")
    with async_round(cfg, tiny, groups, steps=4) as runner:
        runner.load_state(tmp_path / "start", start)
        again = [runner.step(i) for i in range(2)]
        stopped = runner.save_state(tmp_path / "stopped")
    with async_round(cfg, tiny, groups, steps=4) as resumed:
        resumed.load_state(tmp_path / "stopped", stopped)
        again += [resumed.step(i) for i in range(2, 4)]
        resumed_weights = weights(resumed, "resumed")
    assert [r["async/staleness"] for r in first] == [0, 1, 1, 1]
    kept = stopped["source"]["generated"]  # batch 3 (version 2) too, if it was out of the queue by then
    assert 2 in kept and set(kept) <= {2, 3} and all(got.version == k - 1 for k, got in kept.items())
    assert [determined(r) for r in again] == [determined(r) for r in first]
    assert resumed_weights == first_weights


@pytest.mark.integration
def test_partial_rollouts_keep_each_tokens_version_and_log_prob(tiny, groups, tmp_path):
    """ppo.async.partial_rollout with max_staleness 1 and a generator whose decode steps take 0.1 s, so the trainer
    publishes a new version while a batch is being generated: the generator takes it mid-batch, and every token's
    rollout log-prob is that of the version ``token_versions`` names, given the whole sequence before it (worked out
    with a plain forward of each version's saved weights: the KV cache of the rows in flight was computed again with
    the new weights). The batch's own version, which the staleness gate reads, is its first tokens'."""
    folder, tok, prompts = tiny
    cfg = config(ppo={"train_batch_size": 4, "mode": "async", "async": {"max_staleness": 1, "partial_rollout": True}},
                 actor={"ppo_mini_batch_size": 2, "lr": 0.05, "off_policy": {"correction": "tis"}})
    gens = GeneratorPool(slow_generator.SlowStepsGenerator, 1, 1.0, False, queue_size=1, max_restarts=0, timeout_s=60,
                         model=model_spec(cfg, folder), engine=engine_spec(cfg.rollout), shards=2, seed=cfg.seed,
                         partial_rollout=True)
    rows, batches = [], []
    try:
        runner = async_round_runner(cfg, groups, gens, tokenizer=tok, prompts=prompts, seed=3, steps=4)
        for i in range(4):
            runner.save(str(tmp_path / f"v{runner.policy_version}"))
            rows.append(runner.step(i))
            batches.append(runner.last_batch)
    finally:
        gens.shutdown()
    switched = 0
    for step, (row, batch) in enumerate(zip(rows, batches)):
        mask = batch["response_mask"].bool()
        versions = batch["token_versions"][mask]
        assert row["async/staleness"] == step - int(versions.min())  # the batch's version: its first tokens'
        switched += int((versions > versions.min()).any())
        for v in versions.unique().tolist():
            picked = mask & (batch["token_versions"] == v)
            torch.testing.assert_close(batch["rollout_log_probs"][picked],
                                       plain_log_probs(tmp_path / f"v{v}", batch)[picked], rtol=0, atol=1e-4)
        assert row["async/tokens_after_switch_frac"] == pytest.approx(float((versions > versions.min()).float().mean()))
    assert switched >= 1, "no batch took a new version mid-generation"
    assert all(r["async/staleness"] <= 1 and r["async/token_staleness_max"] <= 1 for r in rows)
