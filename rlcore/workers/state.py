"""Step checkpoints on a worker rank: a trained model's full training state, written and read back.

A checkpoint folder (``rlcore.trainer.loop.checkpoint``) holds, per trained model ``name``:

* ``{name}.pt``: the model's parameters and buffers, the optimizer state and the learning-rate schedule,
  unsharded (``torch.distributed.checkpoint.state_dict`` with ``full_state_dict``), written by rank 0: one
  file whatever the strategy (ddp replicas or fsdp shards) and the rank count, keyed by parameter name. A model
  trained with LoRA saves its trained tensors only (the adapters; a value model's head too): the frozen base is
  the model folder the stage started from;
* ``{name}.rng{rank}.pt``: each rank's torch RNG state, the CPU generator's and, on a GPU, the CUDA one's.

Every rank reads the same ``{name}.pt`` back and keeps its own share (all of it under ddp, its shards under
fsdp), so the folder must be on a path every rank reaches (one machine, or a shared filesystem on a
cluster). Files are written under a temporary name, flushed to disk and renamed: a kill leaves either the
old file or the new one.

A worker that trains a model takes its ``save_state``/``load_state`` methods from :class:`TrainedModelState`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import torch

from rlcore.controller.decorator import Dispatch, register
from rlcore.engine.sequence import SequenceModel


def atomic_save(obj: object, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary file that is fsynced and renamed."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_training_state(folder: str | Path, name: str, model: SequenceModel, opt, sched, *, rank: int) -> None:
    """Write ``model``'s weights, ``opt`` and ``sched`` (rank 0) and this rank's RNG into ``folder``.
    A collective under sharding strategies: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # seconds: on use only

    folder = Path(folder)
    frozen = _has_frozen(model)  # LoRA: the base stays as loaded; the adapters are the training state
    model_sd, optim_sd = get_state_dict(model.module, opt, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=frozen))
    if rank == 0:
        state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), "trained_only": frozen}
        peft_config = getattr(model.module, "peft_config", None)
        if peft_config:  # what `rlcore export` needs to put the adapters back on the base
            state["adapter_config"] = peft_config["default"].to_dict()
        atomic_save(state, folder / f"{name}.pt")
    atomic_save(rng_state(), folder / f"{name}.rng{rank}.pt")


def _has_frozen(model: SequenceModel) -> bool:
    return any(not p.requires_grad for p in model.module.parameters())


def rng_state() -> dict[str, Any]:
    """This process's torch RNG states: the CPU generator's, and every CUDA device's where CUDA is initialised."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], where: Path) -> None:
    """Restore :func:`rng_state`; a checkpoint written on a GPU and read without one (or the reverse) is refused."""
    torch.set_rng_state(state["torch"])
    has_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if "cuda" in state and has_cuda:
        torch.cuda.set_rng_state_all(state["cuda"])
    elif "cuda" in state or has_cuda:
        raise ValueError(f"{where}: written {'with' if 'cuda' in state else 'without'} CUDA, read "
                         f"{'with' if has_cuda else 'without'} it: resume with the resources.use_gpu it was written with")


def load_training_state(folder: str | Path, name: str, model: SequenceModel, opt, sched, *, rank: int) -> None:
    """Restore what :func:`save_training_state` wrote (the same rank count is required for the RNG files;
    the weights and optimizer state load under any strategy). A collective under sharding strategies."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict  # seconds: on use only

    folder = Path(folder)
    state = torch.load(folder / f"{name}.pt", map_location="cpu", weights_only=False)
    trained_only = state.get("trained_only", False)
    if trained_only != _has_frozen(model):
        raise ValueError(f"{folder / f'{name}.pt'}: saved {'with' if trained_only else 'without'} LoRA, loaded into a "
                         f"model {'without' if trained_only else 'with'} it")
    set_state_dict(model.module, opt, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(full_state_dict=True, strict=not trained_only))
    sched.load_state_dict(state["sched"])
    path = folder / f"{name}.rng{rank}.pt"
    set_rng_state(torch.load(path, map_location="cpu", weights_only=False), path)


class TrainedModelState:
    """The step-checkpoint methods of a worker rank that trains one model with ``self.opt`` and ``self.sched``:
    the class names the model's attribute (``state_model``) and its files in the folder (``state_name``)."""

    state_name: ClassVar[str]
    """The files' name: ``{state_name}.pt``, ``{state_name}.rng{rank}.pt``."""
    state_model: ClassVar[str]
    """The attribute holding the trained :class:`~rlcore.engine.sequence.SequenceModel`."""
    rank: int
    opt: Any
    sched: Any

    @register(Dispatch.ONE_TO_ALL)
    def save_state(self, folder: str) -> None:
        """Write the model's training state (weights, optimizer, schedule, this rank's RNG) into a step
        checkpoint folder."""
        save_training_state(folder, self.state_name, getattr(self, self.state_model), self.opt, self.sched,
                            rank=self.rank)

    @register(Dispatch.ONE_TO_ALL)
    def load_state(self, folder: str) -> None:
        """Continue from a step checkpoint folder that :meth:`save_state` wrote."""
        load_training_state(folder, self.state_name, getattr(self, self.state_model), self.opt, self.sched,
                            rank=self.rank)
        self.state_loaded()

    def state_loaded(self) -> None:
        """Called after :meth:`load_state` restored the model (nothing by default)."""
