"""The weight-sync check (rlcore.engine.sync_check) on real workers and a real generator: a sync that did not reach the
engine fails, one that did passes, and a generator never samples before a policy version is published."""

from __future__ import annotations

import pytest
import torch

from rlcore.controller import RankPlacement
from rlcore.engine import sync_check
from rlcore.engine.lora import LoraSpec
from rlcore.engine.weights import WeightsPayload, pack_state
from rlcore.rollout import EngineSpec, SamplingParams
from rlcore.workers.generator import GeneratorWorker
from rlcore.workers.rollout import GenerateSpec
from tests.engine.test_lora import UPDATE, rollouts, worker


def test_the_probe_tells_a_synced_engine_from_one_update_behind(tiny_model_dir):
    """In float32 the two sides agree far inside the tolerance, and one update at the default recipe's learning rate
    (1e-4) moves the probe outside it, even on the one-layer test model (2.5e-3 here; 0.04 on the default model)."""
    w = worker(tiny_model_dir, LoraSpec(), engine="hf", lr=1e-4)
    batch = rollouts(w)
    assert sync_check.check(sync_check.engine_log_probs(w.engine, w.probe, w.device), w.probe_log_probs(),
                            dtype="float32", what="synced") < sync_check.TOLERANCE["float32"] / 100
    w.update_actor(batch, UPDATE)
    stale = float((sync_check.engine_log_probs(w.engine, w.probe, w.device) - w.probe_log_probs()).abs().max())
    assert stale > sync_check.TOLERANCE["float32"]


def test_in_bfloat16_the_fingerprint_catches_a_sync_that_never_reached_the_engine(tiny_model_dir):
    """bfloat16's tolerance is wider than one update's effect on the probe; the tensors' fingerprint is exact."""
    w = worker(tiny_model_dir, LoraSpec(), dtype="bfloat16", engine="hf", lr=1e-4)
    batch = rollouts(w)
    w.update_actor(batch, UPDATE)
    w.engine.load_weights = lambda state: None
    with pytest.raises(sync_check.RolloutOutOfSync, match="weights are not the ones it was given"):
        w.generate(batch.only("prompts", "prompt_mask"), GenerateSpec(SamplingParams(max_new_tokens=3), 2, 8))


def test_an_engine_that_computes_otherwise_is_caught_at_the_first_probed_sync(tiny_model_dir):
    """The computation is probed at the first sync and every PROBE_EVERY-th: an engine that reads the trainer's own
    tensors (nothing to fingerprint) but computes something else passes the syncs between and fails at the next
    probed one, naming it; the probed syncs are the only ones that run the probe's forwards."""
    w = worker(tiny_model_dir, LoraSpec(), engine="static")
    assert w.engine_shares
    calls = []
    real = sync_check.engine_log_probs

    def wrong(engine, probe, device):
        calls.append(w.syncs)
        return real(engine, probe, device) + (0.5 if w.syncs > 1 else 0.0)

    sync_check.engine_log_probs = wrong
    try:
        w._sync_rollout()  # sync 1, probed and right
        for _ in range(2, sync_check.PROBE_EVERY):
            w._sync_rollout()
        with pytest.raises(sync_check.RolloutOutOfSync, match=f"weight sync {sync_check.PROBE_EVERY}:"):
            w._sync_rollout()
    finally:
        sync_check.engine_log_probs = real
    assert calls == [1, sync_check.PROBE_EVERY]


class NoVersions:
    """The version actor's ``newer_than`` as a generator calls it, with nothing published."""

    class newer_than:  # noqa: N801 (the actor method's name)
        @staticmethod
        def remote(version: int):
            import ray

            return ray.put(None)


def test_a_generator_checks_each_version_it_loads_and_never_samples_before_one(ray_local, tiny_model_dir):
    from rlcore.controller.generator_pool import WorkItem
    from rlcore.protocol import Batch

    trainer = worker(tiny_model_dir, LoraSpec(rank=4, alpha=8.0), dtype="bfloat16")
    batch = rollouts(trainer)
    trainer.update_actor(batch, UPDATE)
    state, probe_lp = trainer._rollout_state(), trainer.probe_log_probs()
    gen = GeneratorWorker(RankPlacement(0, 1, 1), index=0, queue=None, weights=NoVersions, model=trainer.model_spec,
                          engine=EngineSpec(), shards=1)
    gen.init_model()
    item = WorkItem(0, Batch({"prompts": batch["prompts"], "prompt_mask": batch["prompt_mask"]}), 1)
    with pytest.raises(sync_check.RolloutOutOfSync, match="before any policy version was published"):
        gen.generate_item(item, GenerateSpec(SamplingParams(max_new_tokens=3), 1, 8))
    good = WeightsPayload(pack_state(state), sync_check.fingerprint(state.values()), trainer.probe, probe_lp, "bfloat16")
    assert good.nbytes == sum(v.numel() * 2 for v in state.values())  # the adapters only, in bfloat16
    wrong = WeightsPayload(good.state, (good.fingerprint[0] + 1.0, good.fingerprint[1]), good.probe, probe_lp,
                           "bfloat16")
    with pytest.raises(sync_check.RolloutOutOfSync, match="generator 0, policy version 3"):
        gen.load(wrong, 3)
    gen.load(good, 4)
    assert gen.version == 4
    torch.testing.assert_close(sync_check.engine_log_probs(gen.engine, trainer.probe, gen.device), probe_lp,
                               atol=sync_check.TOLERANCE["bfloat16"], rtol=0)
