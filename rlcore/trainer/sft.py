"""Supervised fine-tuning: response-only NLL on a data-parallel SFT worker group."""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from rlcore.config import Config
from rlcore.controller.worker_group import Pending, WorkerGroup
from rlcore.data.collate import encode_responses, prompt_batch
from rlcore.data.schema import read_rows
from rlcore.protocol import Batch, Metrics
from rlcore.trainer.common import StepLog, model_spec, start_pool
from rlcore.workers.optim import OptimSpec
from rlcore.workers.sft import SFTStepSpec, SFTWorker


IN_FLIGHT = 4  # SFT steps queued on the ranks ahead of the one being logged


def sft_batch(df, tokenizer, cfg: Config, source: str) -> Batch:
    """Prompts plus their demonstrations (``extra_info.answer`` + EOS) as ``responses``."""
    batch = prompt_batch(df, tokenizer, cfg.task.max_prompt_length, source)
    responses, mask = encode_responses(tokenizer, [e["answer"] for e in df["extra_info"]],
                                       cfg.task.max_response_length, source)
    return Batch({**batch.tensors, "responses": responses, "response_mask": mask}, batch.non_tensors)


def epoch_batches(data: Batch, batch_size: int, steps: int, seed: int) -> Iterator[Batch]:
    """``steps`` batches of the tensors of ``data``, in seeded epoch-shuffled order (the rows of an
    epoch that do not fill a batch are left for the reshuffle)."""
    rng = np.random.default_rng(seed)
    order, pos = rng.permutation(len(data)), 0
    for _ in range(steps):
        if pos + batch_size > len(order):  # next epoch: reshuffle
            order, pos = rng.permutation(len(data)), 0
        yield data.select(order[pos : pos + batch_size]).only("prompts", "prompt_mask", "responses", "response_mask")
        pos += batch_size


def run_sft(cfg: Config, *, base_model: Path, tokenizer, data_path: str, out_dir: str, tracker,
            plot_csv: str | None = None) -> dict[str, float]:
    """Train ``cfg.sft.steps`` steps from ``base_model`` and save an HF folder at ``out_dir``.

    Steps are submitted up to ``IN_FLIGHT`` ahead of the one being logged (each rank runs them in
    order, so the result is the same as waiting for each): the ranks never wait for the controller."""
    data = sft_batch(read_rows(data_path), tokenizer, cfg, data_path)
    s = cfg.sft
    optim = OptimSpec(lr=s.lr, weight_decay=s.weight_decay, warmup_steps=s.warmup_steps, total_steps=s.steps)
    step_spec = SFTStepSpec(micro_batch_size=max(1, min(s.micro_batch_size, s.batch_size // cfg.resources.n_workers)),
                            grad_clip=s.grad_clip)
    log = StepLog(tracker, plot_csv)
    bar = tqdm(total=s.steps, desc="sft", unit="step")

    def record(metrics: Metrics) -> None:
        log.log(len(log.rows), metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['sft/loss']:.3f}")

    with start_pool(cfg) as pool:
        group = WorkerGroup(SFTWorker, pool, name="sft", timeout_s=cfg.ray.timeout_s,
                            model=model_spec(cfg, base_model), optim=optim, seed=cfg.seed)
        try:
            group.call(SFTWorker.init_model)
            in_flight: deque[Pending[Metrics]] = deque()
            for batch in epoch_batches(data, s.batch_size, s.steps, cfg.seed):
                in_flight.append(group.submit(SFTWorker.train_step, batch, step_spec))
                if len(in_flight) > IN_FLIGHT:
                    record(in_flight.popleft().result())
            while in_flight:
                record(in_flight.popleft().result())
            group.call(SFTWorker.save, out_dir)
        finally:
            group.shutdown()
            bar.close()
    tail = [r["sft/loss"] for r in log.rows[-10:]]
    return {"sft/final_loss": log.rows[-1]["sft/loss"], "sft/final_loss_last10": float(np.mean(tail)),
            "sft/steps": s.steps}
