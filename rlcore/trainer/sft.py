"""Supervised fine-tuning: response-only NLL on a data-parallel SFT worker group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from rlcore.config import Config
from rlcore.controller.worker_group import WorkerGroup
from rlcore.data.collate import encode_responses, prompt_batch
from rlcore.data.schema import read_rows
from rlcore.protocol import Batch
from rlcore.trainer.common import StepLog, model_spec, start_pool
from rlcore.workers.optim import OptimSpec
from rlcore.workers.sft import SFTStepSpec, SFTWorker


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
    optim = OptimSpec(lr=s.lr, weight_decay=s.weight_decay, warmup_steps=s.warmup_steps, total_steps=s.steps)
    step_spec = SFTStepSpec(micro_batch_size=max(1, min(s.micro_batch_size, s.batch_size // cfg.resources.n_workers)),
                            grad_clip=s.grad_clip)
    rng = np.random.default_rng(cfg.seed)
    order, pos = rng.permutation(len(data)), 0
    log = StepLog(tracker, plot_csv)
    ema = float("nan")  # the loss smoothed for the progress bar
    with start_pool(cfg) as pool:
        group = WorkerGroup(SFTWorker, pool, name="sft", timeout_s=cfg.ray.timeout_s,
                            model=model_spec(cfg, base_model), optim=optim, seed=cfg.seed)
        try:
            group.call(SFTWorker.init_model)
            for step in (bar := tqdm(range(s.steps), desc="sft", unit="step")):
                if pos + s.batch_size > len(order):  # next epoch: reshuffle
                    order, pos = rng.permutation(len(data)), 0
                batch = data.select(order[pos : pos + s.batch_size])
                pos += s.batch_size
                metrics = group.call(SFTWorker.train_step, batch.only("prompts", "prompt_mask", "responses",
                                                                      "response_mask"), step_spec)
                ema = metrics["sft/loss"] if step == 0 else 0.9 * ema + 0.1 * metrics["sft/loss"]
                bar.set_postfix(loss=f"{ema:.3f}")
                log.log(step, metrics)
            group.call(SFTWorker.save, out_dir)
        finally:
            group.shutdown()
    return {"sft/final_loss": log.rows[-1]["sft/loss"], "sft/final_loss_ema": ema, "sft/steps": s.steps}
