"""The ``disk`` check: free space for the repository, the model cache and the temporary folder (Ray's)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rlcore.diagnose.base import Check, Context, Status, model_cache, register, worst

# Free space under these is a warning / a failure: a PPO round writes checkpoints under models/,
# which DVC copies into .dvc/cache; a real model is several GiB per copy.
DISK_WARN_GIB = 5.0
DISK_FAIL_GIB = 1.0


def disk_status(free_bytes: float) -> Status:
    """ok, or warn under :data:`DISK_WARN_GIB`, or fail under :data:`DISK_FAIL_GIB`."""
    gib = free_bytes / 2**30
    return "fail" if gib < DISK_FAIL_GIB else "warn" if gib < DISK_WARN_GIB else "ok"


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@register("disk")
def check_disk(ctx: Context) -> Check:
    places = {"repo": ctx.root, "model cache": model_cache(), "temp (Ray)": Path(tempfile.gettempdir())}
    filesystems: dict[int, tuple[list[str], float]] = {}
    for label, path in places.items():
        here = _existing(path)
        dev = here.stat().st_dev
        labels, free = filesystems.get(dev, ([], shutil.disk_usage(here).free))
        filesystems[dev] = (labels + [f"{label} {path}"], free)
    parts, statuses = [], []
    for labels, free in filesystems.values():
        statuses.append(disk_status(free))
        parts.append(f"{free / 2**30:.1f} GiB free for {', '.join(labels)}")
    status = worst(statuses)
    fix = (f"free some space: under {DISK_FAIL_GIB:g} GiB a stage fails writing checkpoints"
           if status == "fail" else f"under {DISK_WARN_GIB:g} GiB: checkpoints under models/ (and their copies in "
           ".dvc/cache) may not fit; dvc gc -w drops unused cache entries")
    return Check("disk", status, "; ".join(parts), "" if status == "ok" else fix)
