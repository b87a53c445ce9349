"""Supervised fine-tuning: response-only NLL on an FSDP2 worker group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from rlcore.config import Config
from rlcore.data.collate import encode_responses, prompt_batch
from rlcore.data.schema import read_rows
from rlcore.protocol import Batch
from rlcore.trainer.common import StepLog, actor_group, start_pool


def sft_batch(df, tokenizer, cfg: Config, source: str) -> Batch:
    """Prompts plus their demonstrations (``extra_info.answer`` + EOS) as ``responses``."""
    batch = prompt_batch(df, tokenizer, cfg.task.max_prompt_length, source)
    responses, mask = encode_responses(tokenizer, [e["answer"] for e in df["extra_info"]],
                                       cfg.task.max_response_length, source)
    return Batch({**batch.tensors, "responses": responses, "response_mask": mask}, batch.non_tensors)


def run_sft(cfg: Config, *, base_model: Path, tokenizer, data_path: str, out_dir: str, tracker,
            plot_csv: str | None = None) -> dict[str, float]:
    """Train ``cfg.sft.steps`` steps from ``base_model`` and save an HF folder at ``out_dir``."""
    data = sft_batch(read_rows(data_path), tokenizer, cfg, data_path)
    s = cfg.sft
    pool = start_pool(cfg)
    optim = {"lr": s.lr, "weight_decay": s.weight_decay, "warmup_steps": s.warmup_steps, "total_steps": s.steps}
    wg = actor_group(cfg, pool, base_model, ("actor",), optim=optim)
    rng = np.random.default_rng(cfg.seed)
    order, pos = rng.permutation(len(data)), 0
    log = StepLog(tracker, plot_csv)
    micro = max(1, min(s.micro_batch_size, s.batch_size // cfg.resources.n_workers))
    ema = None
    for step in (bar := tqdm(range(s.steps), desc="sft", unit="step")):
        if pos + s.batch_size > len(order):  # next epoch: reshuffle
            order, pos = rng.permutation(len(data)), 0
        idx = order[pos : pos + s.batch_size]
        pos += s.batch_size
        batch = data.select(idx)
        batch.meta.update(micro_batch_size=micro, grad_clip=s.grad_clip)
        metrics = wg.train_sft(batch).meta["metrics"]
        ema = metrics["sft/loss"] if ema is None else 0.9 * ema + 0.1 * metrics["sft/loss"]
        bar.set_postfix(loss=f"{ema:.3f}")
        log.log(step, metrics)
    wg.save(out_dir)
    wg.shutdown()
    pool.release()
    return {"sft/final_loss": log.rows[-1]["sft/loss"], "sft/final_loss_ema": float(ema), "sft/steps": s.steps}
