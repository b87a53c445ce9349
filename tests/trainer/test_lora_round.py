"""A LoRA round on two Ray ranks: GRPO steps whose reference is the adapter-disabled policy, a step checkpoint that
holds the adapters and repeats the next steps exactly when restored, and the saved adapter folder, which
``rlcore export`` merges into a plain model with the trained policy's log-probs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlcore.engine import lora
from rlcore.export import export_model
from rlcore.trainer.loop.pool import start_pool
from rlcore.trainer.round.worker_groups import RoundWorkerGroups
from rlcore.trainer.round.modes import sync_round_runner
from rlcore.workers.actor import ActorRolloutRefWorker, LogProbSpec
from tests.trainer.test_ppo_estimators import HASH_SOURCE, config, plain_log_probs, test_rewards, tiny  # noqa: F401

LORA = {"ppo_mini_batch_size": 2, "lr": 0.01, "lora": {"rank": 4, "alpha": 8.0}, "gradient_checkpointing": True}


@pytest.mark.integration
def test_a_lora_round_checkpoints_resumes_and_exports(tiny, tmp_path):  # noqa: F811
    folder, tok, prompts = tiny
    cfg = config("grpo", actor=LORA)
    with start_pool(cfg) as pool:
        groups = RoundWorkerGroups.start(cfg, pool, str(folder))
        try:
            runner = sync_round_runner(cfg, groups, tokenizer=tok, prompts=prompts, seed=5)
            first = runner.step(0)
            # the adapter starts at 0, so the policy is the reference: their log-probs differ only by rounding (two
            # forwards of the same weights, which a CPU's float kernels need not round alike: -6e-9 seen on a Xeon)
            assert math.isfinite(first["actor/kl_ref"]) and abs(first["actor/kl_ref"]) < 1e-6
            (tmp_path / "state").mkdir()
            state = runner.save_state(tmp_path / "state")
            steps = [runner.step(i) for i in (1, 2)]
            assert steps[-1]["actor/kl_ref"] > 1e-4  # the policy left the adapter-disabled reference
            runner.save(str(tmp_path / "first"))
            batch = runner.last_batch
            trained = runner.actor.call(ActorRolloutRefWorker.compute_log_prob, batch.only(
                "prompts", "prompt_mask", "responses", "response_mask"), LogProbSpec(64))["old_log_probs"]
            runner.load_state(tmp_path / "state", state)
            again = [runner.step(i) for i in (1, 2)]
            runner.save(str(tmp_path / "again"))
        finally:
            groups.shutdown()
    for a, b in zip(steps, again):
        assert {k: v for k, v in a.items() if not k.startswith(("timing_s/", "perf/"))} == \
            {k: v for k, v in b.items() if not k.startswith(("timing_s/", "perf/"))}
    assert all(k in steps[0] for k in ("perf/peak_mem_gen_mib", "perf/peak_mem_ref_mib", "perf/peak_mem_update_mib"))
    saved = tmp_path / "first" / "adapter_model.safetensors"
    assert lora.is_adapter(tmp_path / "first") and saved.read_bytes() == \
        (tmp_path / "again" / "adapter_model.safetensors").read_bytes()
    assert lora.adapter_base(tmp_path / "first") == folder.resolve()
    export_model(tmp_path / "first", tmp_path / "plain")
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "plain"), local_files_only=True)
    mask = batch["response_mask"]
    torch.testing.assert_close(plain_log_probs(exported, batch) * mask, trained * mask, atol=1e-4, rtol=0)
