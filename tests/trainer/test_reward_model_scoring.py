"""reward.model in a stage (rlcore.trainer.samples.reward_model): a worker group colocated with the rollout ranks scores each
response at its last token, its scores are standardised with the folder's statistics and weighted into the
training reward beside the rule; checked against the Hugging Face model run in this process on the same tokens.
The same rollout ranks then take another model in place (``RolloutWorker.load_model``, as the evaluate stage does)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlcore.config import parse_config
from rlcore.data.collate import prompt_batch
from rlcore.engine.model import ModelSpec
from rlcore.engine.reward_model import load_reward_model, save_reward_model
from rlcore.engine.sequence import position_ids, sequences
from rlcore.trainer.loop.pool import start_pool
from rlcore.trainer.samples.scoring import reward_scorer
from rlcore.trainer.samples.reward_model import RewardModelGroup
from rlcore.trainer.samples.generation import rollout_worker_group
from rlcore.trainer.score import sample_rewards


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    torch.manual_seed(3)  # a random head: scores that differ from row to row
    model = load_reward_model(ModelSpec(str(tiny_model_dir)), torch.device("cpu"), frozen=True)
    folder = tmp_path_factory.mktemp("rm") / "rm"
    save_reward_model(model, folder, rank=0, tokenizer=tiny_tokenizer, stats={"mean": 0.25, "std": 0.5})
    return folder


@pytest.fixture(scope="module")
def stage(reward_model_dir, tiny_model_dir, tiny_tokenizer, ray_local):
    """(config, prompts, the rollout group over the tiny model, the reward model's group beside it)."""
    cfg = parse_config({"tracking": {"enabled": False}, "task": {"max_response_length": 5},
                        "reward": {"model": {"path": str(reward_model_dir), "weight": 2.0}}})
    rows = pd.DataFrame([{"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"{i}+{i}"}],
                          "ability": "t", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
                          "extra_info": {"split": "t", "index": i, "question": f"{i}+{i}", "answer": ""}}
                         for i in range(7)])  # 7 x 2 responses: padded to the 2 ranks and trimmed back
    prompts = prompt_batch(rows, tiny_tokenizer, 16, "rows")
    with start_pool(cfg) as pool:
        group = rollout_worker_group(cfg, pool, str(tiny_model_dir), share=2)
        rm = RewardModelGroup(cfg, pool, share=2)
        try:
            yield cfg, prompts, group, rm
        finally:
            group.shutdown()
            rm.shutdown()


@pytest.mark.integration
def test_reward_model_scores_enter_the_reward_standardised_and_weighted(stage, reward_model_dir, tiny_tokenizer):
    cfg, prompts, group, rm = stage
    rewards, gen = sample_rewards(cfg, group, tiny_tokenizer, prompts, scorer=reward_scorer(cfg.reward), n=2,
                                  temperature=1.0, greedy=False, seed=5, desc="test", reward_model=rm)
    hf = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, local_files_only=True)
    ids, mask = sequences(gen)
    with torch.no_grad():  # transformers' own pooling: the rightmost token that is not padding
        raw = hf(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, 0].double().numpy()
    np.testing.assert_allclose(rewards.rm_raw, raw, rtol=1e-5, atol=1e-6)
    value = (raw - 0.25) / 0.5
    np.testing.assert_allclose(rewards.values["rm"], value, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rewards.total, rewards.values["rule"] + 2.0 * value, rtol=1e-5, atol=1e-5)
    m = rewards.metrics()
    assert m["reward/rm/mean"] == pytest.approx(value.mean(), rel=1e-5) and m["reward/rm/raw_mean"] == pytest.approx(
        raw.mean(), rel=1e-5)
    assert len(rewards) == 14 and np.std(raw) > 0


@pytest.mark.integration
def test_rollout_ranks_that_load_another_model_generate_what_a_new_group_over_it_would(stage, tiny_model_dir, tmp_path):
    """After ``load_model`` the ranks sample exactly the tokens a new group over the other model draws (one engine
    over it in this process, sharded as two ranks: ``generate_sharded``); loading the first model back, that one's."""
    from rlcore.engine.tiny_model import materialize_tiny
    from rlcore.rollout import engine_spec
    from rlcore.trainer.loop.model_specs import model_spec
    from rlcore.trainer.samples.generation import generate, generate_spec, generation_input
    from rlcore.workers.rollout import RolloutWorker, generate_sharded, make_engine

    from ..conftest import TINY_SHAPE

    cfg, prompts, group, _ = stage
    spec = generate_spec(cfg, temperature=1.0, seed=11)
    batch = generation_input(prompts, spec)

    def local(folder) -> torch.Tensor:
        engine = make_engine(engine_spec(cfg.rollout), model_spec(cfg, folder), torch.device("cpu"))
        return generate_sharded(engine, batch, spec, shards=2, device=torch.device("cpu"))["responses"]

    def ranks(folder) -> torch.Tensor:
        group.call(RolloutWorker.load_model, model_spec(cfg, folder))
        return generate(group, RolloutWorker.generate, prompts, spec)["responses"]

    other = materialize_tiny(tmp_path, seed=7, **TINY_SHAPE)
    with_other = ranks(other)
    assert torch.equal(with_other, local(other))
    with_first = ranks(tiny_model_dir)
    assert torch.equal(with_first, local(tiny_model_dir)) and not torch.equal(with_first, with_other)
