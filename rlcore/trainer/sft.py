"""Supervised fine-tuning: response-only NLL on a data-parallel SFT worker group."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
from rlcore.agents.check import tool_schemas
from rlcore.config import Config
from rlcore.agents.demonstrations import encode_conversations
from rlcore.data.collate import encode_responses, prompt_batch
from rlcore.data.schema import read_rows
from rlcore.engine.sequence import SEQUENCE_KEYS
from rlcore.errors import DataError
from rlcore.protocol import Batch
from rlcore.trainer.loop.checkpoint import Resume, StepCheckpoints
from rlcore.trainer.loop.job import trained_group, training_job
from rlcore.trainer.loop.model_specs import check_model, model_spec
from rlcore.trainer.loop.step_log import StepLog
from rlcore.trainer.loop.steps import Divergence, StepLoop
from rlcore.workers.optim import OptimSpec
from rlcore.workers.sft import SFTStepSpec, SFTWorker


IN_FLIGHT = 4  # SFT steps queued on the ranks ahead of the one being logged


def sft_batch(df, tokenizer, cfg: Config, source: str, tools: list[dict] | None = None) -> Batch:
    """Prompts plus their demonstrations (``extra_info.answer`` + EOS) as ``responses``. Rows whose ``extra_info``
    holds ``messages`` (multi-turn demonstrations with tool calls: the turns after the prompt) are laid out as the
    tool loop lays out a trajectory, the tool messages between the turns out of the loss
    (:func:`~rlcore.agents.demonstrations.encode_conversations`); ``tools``: the function schemas the prompts show."""
    batch = prompt_batch(df, tokenizer, cfg.task.max_prompt_length, source, tools)
    extra = list(df["extra_info"])
    has = [_has_messages(e) for e in extra]
    if any(has):
        if not all(has):
            raise DataError(f"{source}: row {has.index(False)}: extra_info.messages is missing; some rows have "
                            "multi-turn demonstrations, so every row needs them")
        responses, mask, attention = encode_conversations(tokenizer, [list(e["messages"]) for e in extra],
                                                          cfg.task.max_response_length, source, tools)
        return Batch({**batch.tensors, "responses": responses, "response_mask": mask,
                      "response_attention_mask": attention}, batch.non_tensors)
    responses, mask = encode_responses(tokenizer, [e["answer"] for e in extra],
                                       cfg.task.max_response_length, source)
    return Batch({**batch.tensors, "responses": responses, "response_mask": mask}, batch.non_tensors)


def _has_messages(extra) -> bool:
    messages = extra.get("messages") if isinstance(extra, dict) else None
    return messages is not None and len(messages) > 0


def epoch_batches(data: Batch, batch_size: int, steps: int, seed: int, start: int = 0,
                  fields: tuple[str, ...] = SEQUENCE_KEYS) -> Iterator[Batch]:
    """Batches ``start`` to ``steps - 1`` of the tensors ``fields`` of ``data``, in seeded epoch-shuffled order (the rows
    of an epoch that do not fill a batch are left for the reshuffle). The order only depends on the seed, so
    a resumed run replays the shuffles of the steps before ``start`` and continues with the same batches."""
    rng = np.random.default_rng(seed)
    order, pos = rng.permutation(len(data)), 0
    for step in range(steps):
        if pos + batch_size > len(order):  # next epoch: reshuffle
            order, pos = rng.permutation(len(data)), 0
        if step >= start:
            yield data.select(order[pos : pos + batch_size]).only(*fields)
        pos += batch_size


def run_sft(cfg: Config, *, base_model: Path, tokenizer, data_path: str, out_dir: str, tracker,
            plot_csv: str | None = None, checkpoints: StepCheckpoints | None = None,
            resume: Resume | None = None) -> dict[str, float]:
    """Train ``cfg.sft.steps`` steps from ``base_model`` and save an HF folder at ``out_dir``; with
    ``resume``, continue after its step from its state (``rlcore.trainer.loop.checkpoint``).

    Steps are submitted up to ``IN_FLIGHT`` ahead of the one being logged (each rank runs them in
    order, so the result is the same as waiting for each): the ranks never wait for the controller.
    A step checkpoint is one more call in that order, after its step's; the controller completes it
    when its result comes back, by which time it has recorded exactly the steps before it.

    A step whose loss or gradient norm is not finite is skipped by the workers (``sft/nonfinite_steps``);
    after ``sft.max_nonfinite_steps`` in a row the loop raises :class:`~rlcore.errors.TrainingDiverged` once
    that step is logged."""
    data = sft_batch(read_rows(data_path), tokenizer, cfg, data_path, tools=tool_schemas(cfg.rollout.agent))
    check_model(cfg, base_model, "sft")
    s = cfg.sft
    optim = OptimSpec.of(s, warmup_steps=s.warmup_steps, total_steps=s.steps, offload=cfg.resources.offload.optimizer)
    step_spec = SFTStepSpec(micro_batch_size=max(1, min(s.micro_batch_size, s.batch_size // cfg.resources.n_workers)),
                            grad_clip=s.grad_clip)
    log = StepLog(tracker, plot_csv)
    loop = StepLoop("sft", s.steps, log, tracker=tracker, checkpoints=checkpoints, resume=resume, ahead=IN_FLIGHT,
                    divergence=[Divergence("sft", s.max_nonfinite_steps, ("sft/loss", "sft/grad_norm"),
                                           "lower sft.lr or raise sft.warmup_steps")],
                    postfix=lambda m: {"loss": f"{m['sft/loss']:.3f}"})
    with training_job(cfg, resume) as job:
        sft = job.start(trained_group(SFTWorker, job.pool, name="sft", timeout_s=cfg.ray.timeout_s,
                                      model=model_spec(cfg, base_model, "sft"), optim=optim, seed=cfg.seed))
        batches = epoch_batches(data, s.batch_size, s.steps, cfg.seed, start=loop.start)
        loop.run(lambda step: sft.group.submit(SFTWorker.train_step, next(batches), step_spec),
                 save=lambda folder: sft.group.submit(SFTWorker.save_state, str(folder)),
                 state=lambda: {"model_dir": str(base_model)})
        job.save(lambda: sft.group.call(SFTWorker.save, out_dir), f"the SFT model to {out_dir}")
    tail = [r["sft/loss"] for r in log.rows[-10:]]
    return {"sft/final_loss": log.rows[-1]["sft/loss"], "sft/final_loss_last10": float(np.mean(tail)),
            "sft/steps": s.steps}
