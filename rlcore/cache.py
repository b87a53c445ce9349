"""rlcore's cache folder: ``$RLCORE_CACHE``, default ``~/.cache/rlcore`` (the built-in model's weights,
transformers' lazy-import index, model shapes). Everything in it can be rebuilt; deleting it costs time only."""

from __future__ import annotations

import os
from pathlib import Path


def root() -> Path:
    return Path(os.environ.get("RLCORE_CACHE", Path.home() / ".cache" / "rlcore"))
