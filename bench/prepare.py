"""Build once, reuse after: the task data, the tiny base model and its SFT checkpoint.

Both systems start RL from the same SFT folder (same weights, same tokenizer), because a
random tiny model never earns a reward. Everything lands in ``bench/_work`` (gitignored):
``data-<hash>`` and ``sft-<hash>``, the hashes covering the params each was built from, so
a params.yaml change builds a new one and everything else is reused. SFT runs on rlcore's
own workers and takes a few minutes.

    .venv/bin/python -m bench.prepare
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from bench.settings import fixture_config, paths
from rlcore.config import Config
from rlcore.engine.tiny_model import materialize_tiny
from rlcore.trainer.prepare import write_splits

STAMP = "bench_ready.json"


def run_sft_once(cfg: Config, base: Path, data: Path, out: Path) -> dict:
    """SFT on rlcore's own workers (a private Ray instance, shut down afterwards)."""
    import ray

    from rlcore.engine.model import load_tokenizer
    from rlcore.tracking import NullTracker
    from rlcore.trainer.sft import run_sft

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        metrics = run_sft(cfg, base_model=base, tokenizer=load_tokenizer(base), data_path=str(data),
                          out_dir=str(tmp), tracker=NullTracker())
    finally:
        ray.shutdown()
    tmp.rename(out)
    return metrics


def ensure_prepared() -> dict:
    """Return the info of the SFT fixture, building the data and the checkpoint if missing."""
    p, cfg = paths(), fixture_config()
    if not (p["data"] / STAMP).is_file():
        write_splits(cfg, p["data"])
        (p["data"] / STAMP).write_text(json.dumps(cfg.model_dump(mode="json")["task"], indent=2))
    stamp = p["sft"] / STAMP
    if stamp.is_file():
        return json.loads(stamp.read_text())
    start = time.perf_counter()
    base = materialize_tiny(p["base"], seed=cfg.seed, **cfg.model.tiny.model_dump())
    shutil.rmtree(p["sft"], ignore_errors=True)
    metrics = run_sft_once(cfg, base, p["sft_data"], p["sft"])
    dumped = cfg.model_dump(mode="json")
    info = {"base_model": str(base), "sft_metrics": metrics, "sft_steps": cfg.sft.steps,
            "prepare_s": round(time.perf_counter() - start, 1),
            "built_from": {k: dumped[k] for k in ("seed", "model", "task", "sft")}}
    stamp.write_text(json.dumps(info, indent=2))
    return info


if __name__ == "__main__":
    print(json.dumps(ensure_prepared(), indent=2))
