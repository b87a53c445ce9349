"""Reward-model training: a Bradley-Terry model on preference pairs, on a data-parallel worker group.

The model starts from ``rm.models.<name>.init`` (the SFT model by default) with a fresh one-output head and learns
``r(prompt, chosen) > r(prompt, rejected)``; each step is one AdamW step on ``rm.batch_size`` pairs. Held-out
pairs give ``rm/val_accuracy`` every ``rm.eval_every`` steps and the stage's metrics at the end: pairwise
accuracy, mean margin, and the mean and std of the scores. The mean and std of the scores on the training pairs
(both answers) are saved beside the model (``reward_stats.json``), for ``reward.model.normalize``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from rlcore.config import Config
from rlcore.controller.worker_group import WorkerGroup
from rlcore.data.collate import encode_prompts, encode_responses
from rlcore.data.pairs import read_pairs
from rlcore.errors import DataError
from rlcore.interrupt import training_loop
from rlcore.protocol import Batch, Metrics
from rlcore.trainer.checkpoint import write_error
from rlcore.trainer.common import StepLog, model_spec, start_pool, stop_if_diverged
from rlcore.trainer.sft import epoch_batches
from rlcore.workers.optim import OptimSpec
from rlcore.workers.reward_model import ScoreSpec
from rlcore.workers.rm import RewardTrainWorker, RMStepSpec

PAIR_FIELDS = ("prompts", "prompt_mask", "chosen", "chosen_mask", "rejected", "rejected_mask", "margin")
SCORE_CHUNK = 256  # pairs per scoring call
MAX_NONFINITE_STEPS = 3  # consecutive optimizer steps skipped for a NaN/inf loss or gradient before the stage stops


def pair_batch(path: str, tokenizer, cfg: Config) -> Batch:
    """The pairs of ``path`` as tensors: prompts left-padded, chosen and rejected answers (+ EOS) right-padded,
    ``margin`` float32."""
    pairs = read_pairs(path)
    prompts, prompt_mask = encode_prompts(tokenizer, [p.prompt for p in pairs], cfg.task.max_prompt_length, path)
    tensors = {"prompts": prompts, "prompt_mask": prompt_mask,
               "margin": torch.tensor([p.margin for p in pairs], dtype=torch.float32)}
    for key in ("chosen", "rejected"):
        ids, mask = encode_responses(tokenizer, [getattr(p, key) for p in pairs], cfg.task.max_response_length,
                                     f"{path} (field {key!r})")
        tensors[key], tensors[f"{key}_mask"] = ids, mask
    return Batch(tensors)


def pair_scores(group: WorkerGroup[RewardTrainWorker], pairs: Batch) -> tuple[np.ndarray, np.ndarray]:
    """``(chosen, rejected)`` scores ``[pairs]`` of every pair (padded to the ranks, trimmed back)."""
    parts = []
    for start in range(0, len(pairs), SCORE_CHUNK):
        chunk = pairs.slice(start, start + SCORE_CHUNK)
        parts.append(group.call(RewardTrainWorker.score_pairs, _pad(chunk, group), ScoreSpec(SCORE_CHUNK))
                     .slice(0, len(chunk)))
    out = Batch.concat(parts)
    return out["chosen_scores"].numpy(), out["rejected_scores"].numpy()


def _pad(batch: Batch, group: WorkerGroup) -> Batch:
    pad = -len(batch) % group.world_size
    return Batch.concat([batch, batch.select(np.arange(pad) % len(batch))]) if pad else batch


def pair_metrics(chosen: np.ndarray, rejected: np.ndarray, prefix: str) -> Metrics:
    """Pairwise accuracy (chosen scored above rejected), mean margin, and the scores' mean and std."""
    both = np.concatenate([chosen, rejected])
    return {f"{prefix}accuracy": float((chosen > rejected).mean()), f"{prefix}margin": float((chosen - rejected).mean()),
            f"{prefix}reward_mean": float(both.mean()), f"{prefix}reward_std": float(both.std())}


def run_rm(cfg: Config, *, init: str, tokenizer, train_path: str, test_path: str, out_dir: str, tracker,
           plot_csv: str | None = None) -> Metrics:
    """Train one reward model from ``init`` on the pairs of ``train_path``; save it to ``out_dir`` with its
    normalisation statistics; return the held-out metrics (``rm/test_*``)."""
    r = cfg.rm
    train, test = pair_batch(train_path, tokenizer, cfg), pair_batch(test_path, tokenizer, cfg)
    world = cfg.resources.n_workers
    if r.batch_size % world:
        raise DataError(f"rm.batch_size {r.batch_size} must be divisible by resources.n_workers {world}")
    optim = OptimSpec(lr=r.lr, weight_decay=r.weight_decay, warmup_steps=r.warmup_steps, total_steps=r.steps)
    step_spec = RMStepSpec(micro_batch_size=max(1, min(r.micro_batch_size, r.batch_size // world)),
                           grad_clip=r.grad_clip, center_rewards_coefficient=r.center_rewards_coefficient)
    log = StepLog(tracker, plot_csv)
    with start_pool(cfg) as pool:
        group = WorkerGroup(RewardTrainWorker, pool, name="rm", timeout_s=cfg.ray.timeout_s,
                            model=model_spec(cfg, init), optim=optim, seed=cfg.seed)
        try:
            group.call(RewardTrainWorker.init_model)
            with training_loop() as stop:
                batches = epoch_batches(train, r.batch_size, r.steps, cfg.seed, fields=PAIR_FIELDS)
                for step, batch in enumerate(tqdm(batches, total=r.steps, desc="rm", unit="step")):
                    metrics = group.call(RewardTrainWorker.train_step, batch, step_spec)
                    if r.eval_every and (step + 1) % r.eval_every == 0 and step + 1 < r.steps:
                        metrics.update(pair_metrics(*pair_scores(group, test), "rm/val_"))
                    log.log(step, metrics)
                    stop_if_diverged(log.rows, "rm", MAX_NONFINITE_STEPS, ("rm/loss", "rm/grad_norm"), "lower rm.lr")
                    if stop.requested:
                        stop.stop_now()
            final = pair_metrics(*pair_scores(group, test), "rm/test_")
            log.log(r.steps, {k.replace("rm/test_", "rm/val_"): v for k, v in final.items()})
            train_scores = np.concatenate(pair_scores(group, train))
            mean, std = float(train_scores.mean()), float(max(train_scores.std(), 1e-6))
            stats = {"mean": mean, "std": std, "from": f"{len(train)} training pairs, both answers ({train_path})"}
            try:
                group.call(RewardTrainWorker.save, out_dir, stats)
            except Exception as err:
                raise write_error(err, f"cannot write the reward model to {out_dir}",
                                  "the metrics and plots so far are intact") from err
        finally:
            group.shutdown()
    tail = [row["rm/accuracy"] for row in log.rows if "rm/accuracy" in row][-10:]
    return {**final, "rm/train_accuracy_last10": float(np.mean(tail)), "rm/norm_mean": mean,
            "rm/norm_std": std, "rm/steps": r.steps, "rm/train_pairs": len(train), "rm/test_pairs": len(test)}
