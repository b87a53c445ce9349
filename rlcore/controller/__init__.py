"""The single controller's tools: Ray start-up and resource pools (``resource_pool``), worker groups
(``worker_group``), dispatch declarations (``decorator``) and balancing work over ranks (``balance``).

``decorator`` needs no Ray, so worker classes (which only declare their dispatch) import on a
machine without it; the modules that drive Ray are imported by name where they are used.
"""

from rlcore.controller.decorator import Dispatch, RankPlacement, register

__all__ = ["Dispatch", "RankPlacement", "register"]
