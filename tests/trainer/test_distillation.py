"""On-policy distillation: the teacher's check before Ray starts, and a round whose teacher scores the student's own
samples on a worker group of its own (``algorithm.adv_estimator: distill``)."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest
import ray
import torch

from rlcore.config import parse_config
from rlcore.data.collate import prompt_batch
from rlcore.engine.model import load_tokenizer
from rlcore.engine.tiny_model import materialize_tiny
from rlcore.errors import ConfigError, InputNotFound
from rlcore.rewards.rule import RULES
from rlcore.trainer.loop.pool import start_pool
from rlcore.trainer.round.modes import sync_round_runner
from rlcore.trainer.round.teacher import check_teacher
from rlcore.trainer.round.worker_groups import RoundWorkerGroups
from tests.trainer.reward_fns import hash_reward
from tests.trainer.test_async_ppo import gone, plain_log_probs

SOURCE = "test_distill_hash"
SHAPE = {"arch": "llama", "num_layers": 1, "intermediate_size": 64, "max_position_embeddings": 64}


def config(**over):
    raw = {"ray": {"num_cpus": 2}, "tracking": {"enabled": False}, "resources": {"n_workers": 1},
           "rollout": {"n": 4}, "task": {"max_response_length": 5}, "algorithm": {"adv_estimator": "distill"},
           "actor": {"ppo_mini_batch_size": 4, "lr": 0.01}, "ppo": {"train_batch_size": 4}}
    for k, v in over.items():
        raw.setdefault(k, {}).update(v)
    return parse_config(raw)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A student and a larger teacher of another seed, both with the built-in tokenizer."""
    root = tmp_path_factory.mktemp("models")
    student = materialize_tiny(root / "student", seed=0, hidden_size=32, num_heads=2, **SHAPE)
    teacher = materialize_tiny(root / "teacher", seed=5, hidden_size=64, num_heads=4, **SHAPE)
    return student, teacher


def test_a_teacher_whose_tokenizer_differs_is_refused_in_one_line(models, tmp_path):
    student, teacher = models
    cfg = config(distill={"teacher": str(teacher)})
    check_teacher(cfg, student)  # the built-in tokenizer on both sides
    other = tmp_path / "other"
    shutil.copytree(teacher, other)
    tok = load_tokenizer(other)
    tok.add_tokens(["<tool>"])
    tok.save_pretrained(other)
    with pytest.raises(ConfigError) as err:
        check_teacher(config(distill={"teacher": str(other)}), student)
    line = str(err.value)
    assert "\n" not in line and f"distill.teacher {other}" in line and "'<tool>'" in line and "tokenizer" in line
    with pytest.raises(InputNotFound, match="distill.teacher .*no model folder"):
        check_teacher(config(distill={"teacher": str(tmp_path / "nowhere")}), student)
    check_teacher(config(algorithm={"adv_estimator": "grpo"}, distill={"teacher": str(tmp_path / "nowhere")}),
                  student)  # an estimator without a teacher never reads it


@pytest.fixture(scope="module", autouse=True)
def test_reward():
    RULES.register(SOURCE)(hash_reward)
    yield
    RULES._items.pop(SOURCE)


@pytest.mark.integration
def test_the_teacher_scores_the_students_samples_and_the_advantage_is_their_gap(models, ray_local, tmp_path):
    """One distillation step with the reward's advantage mixed in at weight 0.5: the teacher's log-probs are the
    teacher's own (a plain Hugging Face forward of its folder on the sampled batch), each token's advantage is the
    teacher's log-prob minus the student's (the rollout's, the policy that sampled) plus half the reward's GRPO
    advantage, the student moves, and the teacher's group is gone after the round's groups stop."""
    student, teacher = models
    tok = load_tokenizer(student)
    rows = pd.DataFrame([{"data_source": SOURCE, "prompt": [{"role": "user", "content": f"{i}+{i}"}], "ability": "t",
                          "reward_model": {"style": "rule", "ground_truth": "0"},
                          "extra_info": {"split": "rl", "index": i, "question": f"{i}+{i}", "answer": ""}}
                         for i in range(8)])
    cfg = config(distill={"teacher": str(teacher), "reward_weight": 0.5})
    with start_pool(cfg) as pool:
        groups = RoundWorkerGroups.start(cfg, pool, str(student))
        try:
            runner = sync_round_runner(cfg, groups, tokenizer=tok, prompts=prompt_batch(rows, tok, 16, "rows"), seed=1)
            runner.save(str(tmp_path / "before"))
            m = runner.step(0)
            runner.save(str(tmp_path / "after"))
            batch = runner.last_batch
            handles = list(groups.teacher.workers)
        finally:
            groups.shutdown()
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(batch["teacher_log_probs"][mask], plain_log_probs(teacher, batch)[mask],
                               rtol=0, atol=1e-4)
    scores, uids = batch["scores"], list(batch["uid"])
    outcome = torch.zeros(len(scores))
    for uid in set(uids):  # GRPO's advantage of each sample within its prompt's group
        rows_of = [i for i, u in enumerate(uids) if u == uid]
        group = scores[rows_of]
        outcome[rows_of] = (group - group.mean()) / (group.std() + 1e-6)
    expected = (batch["teacher_log_probs"] - batch["rollout_log_probs"] + 0.5 * outcome[:, None]) * mask
    torch.testing.assert_close(batch["advantages"], expected, rtol=0, atol=1e-5)
    gap = (batch["rollout_log_probs"] - batch["teacher_log_probs"])[mask].mean()
    assert m["distill/reverse_kl"] == pytest.approx(float(gap), abs=1e-6) and "timing_s/teacher" in m
    weights = [(tmp_path / d / "model.safetensors").read_bytes() for d in ("before", "after")]
    assert weights[0] != weights[1]
    assert all(gone(h) for h in handles)
