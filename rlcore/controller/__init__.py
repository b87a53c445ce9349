"""The single controller's tools: Ray start-up, resource pools, worker groups, dispatch.

``Dispatch`` and ``register`` need no Ray, so worker classes (which only declare their dispatch)
import on a machine without it; ``ResourcePool``, ``start_ray`` and ``WorkerGroup`` import Ray
on first use.
"""

from __future__ import annotations

import importlib

from rlcore.controller.decorator import Dispatch, register

# name -> the submodule that defines it (and imports ray)
_RAY_NAMES = {"ResourcePool": "resource_pool", "start_ray": "resource_pool", "WorkerGroup": "worker_group"}

__all__ = ["Dispatch", "register", "ResourcePool", "start_ray", "WorkerGroup"]


def __getattr__(name: str):
    if name in _RAY_NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_RAY_NAMES[name]}"), name)
        globals()[name] = value  # later look-ups skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
