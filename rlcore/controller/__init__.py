"""The single controller's tools: Ray start-up, resource pools, worker groups, dispatch."""

from rlcore.controller.decorator import Dispatch, register
from rlcore.controller.resource_pool import ResourcePool, start_ray
from rlcore.controller.worker_group import WorkerGroup

__all__ = ["Dispatch", "register", "ResourcePool", "start_ray", "WorkerGroup"]
