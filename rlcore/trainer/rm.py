"""Reward-model training: a Bradley-Terry model on preference pairs, on a data-parallel worker group.

The model starts from ``rm.models.<name>.init`` (the SFT model by default) with a fresh one-output head and learns
``r(prompt, chosen) > r(prompt, rejected)``; each step is one AdamW step on ``rm.batch_size`` pairs. Held-out
pairs give ``rm/val_accuracy`` every ``rm.eval_every`` steps and the stage's metrics at the end: pairwise
accuracy, mean margin, and the mean and std of the scores. The mean and std of the scores on the training pairs
(both answers) are saved beside the model (``reward_stats.json``), for ``reward.model.normalize``.
"""

from __future__ import annotations

import numpy as np
import torch

from rlcore.config import Config
from rlcore.controller.worker_group import WorkerGroup
from rlcore.data.collate import encode_prompts, encode_responses
from rlcore.data.pairs import read_pairs
from rlcore.engine.sequence import response_attention
from rlcore.errors import DataError
from rlcore.protocol import Batch, Metrics
from rlcore.trainer.loop.checkpoint import Resume, StepCheckpoints
from rlcore.trainer.loop.job import trained_group, training_job
from rlcore.trainer.loop.model_specs import model_spec
from rlcore.trainer.loop.step_log import StepLog
from rlcore.trainer.samples.generation import rollout_worker_group, sample_chunks
from rlcore.trainer.sft import epoch_batches
from rlcore.trainer.loop.steps import Divergence, Done, StepLoop
from rlcore.workers.optim import OptimSpec
from rlcore.workers.reward_model import ScoreSpec
from rlcore.workers.rm_training import RewardTrainWorker, RMStepSpec

PAIR_FIELDS = ("prompts", "prompt_mask", "chosen", "chosen_mask", "rejected", "rejected_mask", "margin")
SCORE_CHUNK = 256  # pairs per scoring call


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


def self_play_pairs(cfg: Config, pool, init: str, pairs: Batch, k: int, seed: int, desc: str) -> Batch:
    """SPIN-style negatives: ``k`` samples of the model at ``init`` for each pair's prompt (temperature 1); each
    distinct sample that is not token for token the pair's chosen answer becomes a pair ``(chosen, sample)``, with
    the pair's margin. The sampled tokens are used as they came (no re-tokenizing; a sample cut at the length limit
    has no EOS, as in a PPO step)."""
    group = rollout_worker_group(cfg, pool, init)
    try:
        gen = sample_chunks(cfg, group, pairs.only("prompts", "prompt_mask"), n=k, temperature=1.0, greedy=False,
                            seed=seed, desc=desc)
    finally:
        group.shutdown()
    source: np.ndarray = np.repeat(np.arange(len(pairs)), k)
    chosen = pairs["chosen"] * pairs["chosen_mask"]
    keep, seen = [], set()
    attention = response_attention(gen)  # a tool-loop trajectory's observations are part of the sample too
    for row, (i, ids, mask) in enumerate(zip(source, gen["responses"], attention)):
        sample = ids * mask
        key = (int(i), tuple(sample.tolist()))
        if key in seen or torch.equal(sample, chosen[i]):
            continue
        seen.add(key)
        keep.append(row)
    rows = torch.as_tensor(source[keep])
    return Batch({"prompts": pairs["prompts"][rows], "prompt_mask": pairs["prompt_mask"][rows],
                  "chosen": pairs["chosen"][rows], "chosen_mask": pairs["chosen_mask"][rows],
                  "rejected": gen["responses"][keep], "rejected_mask": attention[keep],
                  "margin": pairs["margin"][rows]})


def run_rm(cfg: Config, *, init: str, tokenizer, train_path: str, test_path: str, out_dir: str, tracker,
           plot_csv: str | None = None, self_play: int = 0, checkpoints: StepCheckpoints | None = None,
           resume: Resume | None = None) -> Metrics:
    """Train one reward model from ``init`` on the pairs of ``train_path`` (and ``self_play`` negatives per prompt:
    :func:`self_play_pairs`); save it to ``out_dir`` with its normalisation statistics; return the held-out metrics
    (``rm/test_*``; with self-play, ``rm/test_self_play_accuracy``: the answer against the init model's own
    samples of the held-out prompts). With ``resume``, continue after its step from its state: the self-play
    pairs are drawn again (the same seeds give the same pairs) and the batches of the steps before are skipped."""
    r = cfg.rm
    train, test = pair_batch(train_path, tokenizer, cfg), pair_batch(test_path, tokenizer, cfg)
    world = cfg.resources.n_workers
    if r.batch_size % world:
        raise DataError(f"rm.batch_size {r.batch_size} must be divisible by resources.n_workers {world}")
    optim = OptimSpec.of(r, warmup_steps=r.warmup_steps, total_steps=r.steps, offload=cfg.resources.offload.optimizer)
    step_spec = RMStepSpec(micro_batch_size=max(1, min(r.micro_batch_size, r.batch_size // world)),
                           grad_clip=r.grad_clip, center_rewards_coefficient=r.center_rewards_coefficient)
    log = StepLog(tracker, plot_csv)
    loop = StepLoop("rm", r.steps, log, tracker=tracker, checkpoints=checkpoints, resume=resume,
                    divergence=[Divergence("rm", r.max_nonfinite_steps, ("rm/loss", "rm/grad_norm"), "lower rm.lr")],
                    postfix=lambda m: {"loss": f"{m['rm/loss']:.3f}"})
    extra: Metrics = {}
    with training_job(cfg, resume) as job:
        if self_play:
            played = self_play_pairs(cfg, job.pool, init, train, self_play, cfg.seed, "rm self-play")
            test_played = self_play_pairs(cfg, job.pool, init, test, self_play, cfg.seed + 1, "rm self-play (held out)")
            train = Batch.concat([train, played])
            extra = {"rm/self_play_pairs": len(played), "rm/test_self_play_pairs": len(test_played)}
        rm = job.start(trained_group(RewardTrainWorker, job.pool, name="rm", timeout_s=cfg.ray.timeout_s,
                                     model=model_spec(cfg, init), optim=optim, seed=cfg.seed))
        group = rm.group
        batches = epoch_batches(train, r.batch_size, r.steps, cfg.seed, start=loop.start, fields=PAIR_FIELDS)

        def step(n: int) -> Done:
            metrics = group.call(RewardTrainWorker.train_step, next(batches), step_spec)
            if r.eval_every and (n + 1) % r.eval_every == 0 and n + 1 < r.steps:
                metrics.update(pair_metrics(*pair_scores(group, test), "rm/val_"))
            return Done(metrics)

        loop.run(step, save=lambda folder: Done(group.call(RewardTrainWorker.save_state, str(folder))))
        final = pair_metrics(*pair_scores(group, test), "rm/test_")
        if self_play and len(test_played):
            chosen, rejected = pair_scores(group, test_played)
            extra["rm/test_self_play_accuracy"] = float((chosen > rejected).mean())
        log.log(r.steps, {k.replace("rm/test_", "rm/val_"): v for k, v in final.items()})
        train_scores = np.concatenate(pair_scores(group, train))
        mean, std = float(train_scores.mean()), float(max(train_scores.std(), 1e-6))
        stats = {"mean": mean, "std": std, "from": f"{len(train)} training pairs, both answers ({train_path})"}
        job.save(lambda: group.call(RewardTrainWorker.save, out_dir, stats), f"the reward model to {out_dir}",
                 "the metrics and plots so far are intact")
    tail = [row["rm/accuracy"] for row in log.rows if "rm/accuracy" in row][-10:]
    return {**final, **extra, "rm/train_accuracy_last10": float(np.mean(tail)), "rm/norm_mean": mean,
            "rm/norm_std": std, "rm/steps": r.steps, "rm/train_pairs": len(train), "rm/test_pairs": len(test)}
