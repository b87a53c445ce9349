"""rlcore changes tried out by monkeypatching inside the benchmark's own processes.

rlcore itself is not edited. ``BENCH_PATCHES`` (comma-separated names of WORKER_PATCHES,
set from ``--patches``) is read by ``bench.ours`` (the controller) and, through the
environment Ray workers inherit, by every worker rank, which applies the patches when it is
constructed. Each patch is the experiment behind one recommendation in bench/EXPERIMENTS.md.

    .venv/bin/python -m bench.ab --patches trim_prompt_pad              # paired A/B, ours only
    .venv/bin/python -m bench.run_bench --patches unshard_sync,keep_unsharded --out /tmp/r.md
"""

from __future__ import annotations

import functools
import os

import torch

from rlcore.workers.actor import ActorRolloutRefWorker


def active() -> list[str]:
    names = [n for n in os.environ.get("BENCH_PATCHES", "").split(",") if n]
    unknown = set(names) - set(WORKER_PATCHES)
    if unknown:
        raise ValueError(f"BENCH_PATCHES: unknown {sorted(unknown)}; known: {sorted(WORKER_PATCHES)}")
    return names


def unshard_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """distributed.full_state_dict with one all-gather per FSDP group instead of one per parameter."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in groups:
        m.unshard()
    try:
        return {name: p.detach().clone() for name, p in model.named_parameters()}
    finally:
        for m in groups:
            m.reshard()


def _unshard_sync() -> None:
    from rlcore.engine import distributed

    distributed.full_state_dict = unshard_full_state_dict


def _keep_unsharded() -> None:
    """FSDP2 reshard_after_forward=False: parameters gathered in forward stay for backward (ZeRO-2)."""
    from rlcore.engine import distributed

    distributed.fully_shard = functools.partial(distributed.fully_shard, reshard_after_forward=False)


def _foreach_adam() -> None:
    """AdamW takes the multi-tensor (foreach) path; on CPU torch defaults to one tensor at a time."""
    from rlcore.workers import optim

    optim.torch = _TorchWithForeachAdamW()


class _TorchWithForeachAdamW:
    """``torch`` as rlcore.workers.optim sees it, except ``torch.optim.AdamW`` uses foreach=True."""

    def __getattr__(self, name):
        if name == "optim":
            return _OptimNamespace()
        return getattr(torch, name)


class _OptimNamespace:
    def __getattr__(self, name):
        if name == "AdamW":
            return functools.partial(torch.optim.AdamW, foreach=True)
        return getattr(torch.optim, name)


def _trim_prompt_pad() -> None:
    """Drop the leading columns that are padding in every row before each forward (prompts are
    left-padded to task.max_prompt_length, 16, but the longest prompt here is 8 tokens)."""
    from rlcore.rollout.hf import HFRolloutEngine
    from rlcore.workers import actor

    def first_used(mask: torch.Tensor) -> int:
        used = mask.any(0).nonzero()
        return int(used[0]) if len(used) else 0

    plain_sequences, plain_generate = actor.sequences, HFRolloutEngine.generate

    def sequences(batch):
        ids, mask = plain_sequences(batch)
        start = first_used(mask)
        return ids[:, start:], mask[:, start:]

    def generate(self, input_ids, attention_mask, params, generator=None):
        start = first_used(attention_mask)
        return plain_generate(self, input_ids[:, start:], attention_mask[:, start:], params, generator=generator)

    actor.sequences, HFRolloutEngine.generate = sequences, generate


def _logits_to_keep() -> None:
    """Ask the model for logits of the response positions only (HF ``logits_to_keep``), not all positions."""
    from rlcore.engine import logprob

    def response_logits(model, input_ids, attention_mask, response_len: int) -> torch.Tensor:
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=logprob.position_ids(attention_mask), use_cache=False,
                    logits_to_keep=response_len + 1)
        return out.logits[:, :-1]

    logprob.response_logits = response_logits


def _entropy_no_grad() -> None:
    """Entropy (logged only; entropy_coeff is 0 here) computed off the autograd graph."""
    from rlcore.engine import logprob

    plain = logprob.entropy_from_logits
    logprob.entropy_from_logits = lambda logits: plain(logits.detach())


def _rebuild_batch(arrays: dict, tensors: dict, non_tensors: dict, meta: dict):
    """Unpickle side of numpy_transport: numpy arrays (read-only views of Ray's buffers) -> tensors."""
    import numpy as np

    from rlcore.protocol import Batch

    return Batch({**{k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}, **tensors}, non_tensors, meta)


def _batch_reduce(self):
    """Pickle a Batch's tensors as numpy arrays, which Ray sends out-of-band (zero-copy) instead of
    through torch's pickler; dtypes numpy lacks (bfloat16) and grad-requiring tensors stay tensors."""
    arrays = {k: v.numpy() for k, v in self.tensors.items()
              if isinstance(v, torch.Tensor) and v.dtype != torch.bfloat16 and not v.requires_grad}
    tensors = {k: v for k, v in self.tensors.items() if k not in arrays}
    return _rebuild_batch, (arrays, tensors, self.non_tensors, self.meta)


def _numpy_transport() -> None:
    from rlcore import protocol

    protocol.Batch.__reduce__ = _batch_reduce


WORKER_PATCHES = {"unshard_sync": _unshard_sync, "keep_unsharded": _keep_unsharded, "foreach_adam": _foreach_adam,
                  "trim_prompt_pad": _trim_prompt_pad, "logits_to_keep": _logits_to_keep,
                  "entropy_no_grad": _entropy_no_grad, "numpy_transport": _numpy_transport}
CONTROLLER_PATCHES = {"numpy_transport"}  # also applied in the controller (both ends of the transfer)


class PatchedWorker(ActorRolloutRefWorker):
    """The rlcore worker, with this process's BENCH_PATCHES applied before it builds anything."""

    def __init__(self, *args, **kwargs):
        for name in active():
            WORKER_PATCHES[name]()
        super().__init__(*args, **kwargs)


def apply_controller() -> list[str]:
    """In the controller: make rlcore start PatchedWorker ranks when any patch is asked for."""
    names = active()
    if names:
        from rlcore.trainer import common

        common.ActorRolloutRefWorker = PatchedWorker
        for name in CONTROLLER_PATCHES.intersection(names):
            WORKER_PATCHES[name]()
    return names
