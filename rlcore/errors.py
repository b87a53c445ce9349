"""The exceptions that mean "bad input", "a worker was lost" or "the training diverged", not "bug".

A stage turns these, and only these, into one line on stderr (``rlcore.stage.frame.stage_errors``): bad input
(:class:`UserError`) exits with code 2, a diverged training (:class:`TrainingDiverged`) with code 3, a lost
worker (:class:`WorkerDied`) with code 75; every other exception is a bug and keeps its traceback. Each
message names the key, file, row or field and what was expected, the worker group, rank and method that
was lost, or the step that diverged.
"""

from __future__ import annotations

VLLM_INSTALL_HINT = ("vLLM is not installed in this Python environment: `make setup-vllm` builds .venv-vllm with vLLM's "
                     "CPU build; then `. .venv-vllm/bin/activate` and run again (docs/concepts/engines.md)")
"""How to get the ``vllm`` rollout engine: the message of the config check (``rlcore.stage.frame``) and of the engine's
own import (``rlcore.rollout.vllm_engine``)."""


class UserError(Exception):
    """Bad input a user can fix: params, paths, data rows, model folders."""


class ConfigError(UserError, ValueError):
    """A params.yaml problem (or a command-line value standing in for one), naming the key."""


class DataError(UserError, ValueError):
    """A dataset file or row that does not follow the schema, naming the file, row and field."""


class InputNotFound(UserError, FileNotFoundError):
    """A file or folder a stage reads does not exist."""


class WorkerDied(Exception):
    """A rank of a worker group was lost during a call: its process was killed or crashed, or its node
    left the cluster. Nothing is wrong with the input; running the stage again resumes from its last
    step checkpoint. The message names the worker group, the rank, the method and what Ray said."""

    def __init__(self, group: str, rank: int, method: str, cause: str):
        super().__init__(f"worker group {group!r} rank {rank} died during {method} ({cause})")
        self.group, self.rank, self.method, self.cause = group, rank, method, cause

    def __reduce__(self):
        return type(self), (self.group, self.rank, self.method, self.cause)


class TrainingDiverged(Exception):
    """A training loop stopped after too many consecutive optimizer steps with a NaN or infinite loss or
    gradient norm (``actor``/``critic``/``sft.max_nonfinite_steps``). Neither bad input nor a bug, and running
    the stage again with the same params diverges again: the message names the step, the last finite
    metrics and what to change."""
