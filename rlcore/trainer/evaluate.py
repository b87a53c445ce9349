"""Evaluation on the held-out test split: greedy pass@1 and sampled pass@k per model, and each reward function's mean."""

from __future__ import annotations

import numpy as np

from rlcore.agents.batch import agent_metrics, transcript
from rlcore.agents.check import tool_schemas
from rlcore.config import Config
from rlcore.controller.worker_group import WorkerGroup
from rlcore.data.collate import decode_responses, prompt_batch
from rlcore.rewards.checks import read_reward_rows
from rlcore.rewards.generations import pass_at_k
from rlcore.rewards.scoring import RewardScorer
from rlcore.engine.sequence import response_attention
from rlcore.trainer.loop.pool import start_pool
from rlcore.trainer.loop.model_specs import model_spec
from rlcore.trainer.samples.scoring import reward_scorer
from rlcore.trainer.samples.reward_model import RewardModelGroup, colocated, start_reward_model
from rlcore.trainer.samples.generation import rollout_worker_group
from rlcore.trainer.score import sample_rewards
from rlcore.workers.rollout import RolloutWorker


def evaluate_model(cfg: Config, group: WorkerGroup[RolloutWorker], tokenizer, prompts, name: str,
                   scorer: RewardScorer, reward_model: RewardModelGroup | None = None
                   ) -> tuple[dict, list[dict], list[int]]:
    """Metrics ``{name}/greedy_pass@1``, ``{name}/pass@k``, ..., a sample table, and whether the greedy response to
    each prompt is correct (1 or 0, in the prompts' order), for the model ``group`` holds."""
    e = cfg.evaluate
    greedy, gen = sample_rewards(cfg, group, tokenizer, prompts, scorer=scorer, n=1, temperature=1.0,
                                 greedy=True, seed=cfg.seed, desc=f"eval {name} greedy", reward_model=reward_model)
    sampled, _ = sample_rewards(cfg, group, tokenizer, prompts, scorer=scorer, n=e.n_samples,
                                temperature=e.temperature, greedy=False, seed=cfg.seed + 1,
                                desc=f"eval {name} sampled", reward_model=reward_model)
    passed = (sampled.acc >= 1.0).reshape(len(prompts), e.n_samples)
    correct = passed.sum(axis=1).astype(int)
    lengths = response_attention(gen).sum(-1).float()
    metrics = {
        f"{name}/greedy_pass@1": float((greedy.acc >= 1.0).mean()),
        f"{name}/pass@1": float(passed.mean()),
        f"{name}/pass@{e.k}": float(np.mean([pass_at_k(e.n_samples, c, e.k) for c in correct])),
        f"{name}/greedy_response_length": float(lengths.mean()),
        f"{name}/reward_mean": float(sampled.total.mean()),
        **{f"{name}/{k}": v for k, v in sampled.metrics().items()},
        **agent_metrics(gen, f"{name}/agent"),
    }
    texts = [transcript(m) for m in gen["agent_messages"]] if "agent_messages" in gen else decode_responses(
        tokenizer, gen["responses"], gen["response_mask"])
    table = [{"model": name, "question": prompts["question"][i], "ground_truth": prompts["ground_truth"][i],
              "greedy_response": texts[i], "reward": float(greedy.total[i]), "correct": bool(greedy.acc[i] >= 1.0)}
             for i in range(min(e.table_rows, len(texts)))]
    return metrics, table, [int(a >= 1.0) for a in greedy.acc]


def run_evaluate(cfg: Config, *, models: dict[str, str], tokenizer, data_path: str
                 ) -> tuple[dict, list[dict], dict[str, list[int]]]:
    """Evaluate each named model folder on ``data_path``; also the gain of the last over the first, and each model's
    greedy correctness per test problem (``{name: [1 or 0, ...]}`` in the test split's order: what a paired
    comparison of two runs on the same problems needs, rlcore.compare.stats). One group of
    rollout ranks serves every model: each after the first is loaded into the same processes
    (:meth:`RolloutWorker.load_model`; the same numbers as a group of its own, ~9 CPU-seconds of start-up less per
    rank)."""
    df = read_reward_rows(data_path, cfg.reward)
    scorer = reward_scorer(cfg.reward, df, data_path)
    prompts = prompt_batch(df, tokenizer, cfg.task.max_prompt_length, data_path, tool_schemas(cfg.rollout.agent))
    metrics, table, problems = {"test/n_prompts": len(prompts)}, [], {}
    with start_pool(cfg) as pool:
        rm = start_reward_model(cfg, pool, share=2)
        group = None
        try:
            for name, path in models.items():
                if group is None:
                    group = rollout_worker_group(cfg, pool, path, share=1 + colocated(cfg))
                else:
                    group.call(RolloutWorker.load_model, model_spec(cfg, path))
                m, t, problems[name] = evaluate_model(cfg, group, tokenizer, prompts, name, scorer, rm)
                metrics.update(m)
                table += t
        finally:
            if group is not None:
                group.shutdown()
            if rm is not None:
                rm.shutdown()
    first, last = list(models)[0], list(models)[-1]
    metrics["gain/greedy_pass@1"] = metrics[f"{last}/greedy_pass@1"] - metrics[f"{first}/greedy_pass@1"]
    return metrics, table, problems
