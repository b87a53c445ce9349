"""Is this machine ready to run the pipeline? The checks behind ``rlcore diagnose``, one module each.

Each check is a small function ``fn(ctx) -> Check`` registered in :data:`CHECKS`, in the order
the report lists them (the order of the imports below): Python (:mod:`.python`), installed package
versions (:mod:`.packages`), torch with CUDA, devices and NCCL (:mod:`.torch_check`), the CPU kernels a run
gets (:mod:`.kernels_check`), Ray
(:mod:`.ray_check`), DVC (:mod:`.dvc_check`), MLflow (:mod:`.mlflow_check`), disk space (:mod:`.disk`),
the model folder (:mod:`.model`), whether the model, its copies and optimizer fit in memory (:mod:`.memory`). A :class:`Check` is ``ok``, ``warn`` (works, but something deserves a
look) or ``fail`` (a stage would not run); warn and fail always say what to do.

Checks only look: none creates an MLflow run or a store, changes the DVC pipeline or leaves a Ray
instance behind (the MLflow store is opened read-only; ``dvc status`` only takes DVC's lock for a moment).
Each one is bounded in time (:func:`~rlcore.diagnose.base.run_check`); what may hang (starting or joining
Ray, ``dvc status``) runs in a child process that is killed at the deadline. Importing this package loads
nothing heavy: torch loads inside the torch check, Ray only in the child process.
"""

from __future__ import annotations

# the checks register in import order, which is the report's order
# isort: off
from rlcore.diagnose import (  # noqa: F401
    python,
    packages,
    torch_check,
    kernels_check,
    ray_check,
    dvc_check,
    mlflow_check,
    disk,
    model,
    memory,
)
# isort: on
from rlcore.diagnose.base import (
    CHECKS,
    DEFAULT_TIMEOUT_S,
    STATUSES,
    Check,
    Context,
    Status,
    repo_root,
    run_check,
    run_checks,
)

__all__ = ["CHECKS", "DEFAULT_TIMEOUT_S", "STATUSES", "Check", "Context", "Status", "repo_root", "run_check",
           "run_checks"]
