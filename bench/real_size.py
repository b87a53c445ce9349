"""A real model size on this machine: GRPO steps of a published model's shape (random weights) with rlcore's round.

``rlcore init-model --shape <shape>`` writes the model (the built-in character tokenizer, the embedding and output
padded to the real vocabulary), the bench fixture's arithmetic data gives the prompts, and ``rlcore.trainer.round.modes``'s
round runs ``--steps`` steps (the first is a warm-up) with the settings of each ``--mode``:

* ``lora``: rank-16 LoRA on every linear layer, gradient checkpointing (``examples/lora.yaml``'s adapter);
* ``lora-no-ckpt``: the same without gradient checkpointing (what checkpointing saves);
* ``full``: every parameter trained, and the reference as a second copy.

Before a mode runs, ``rlcore.engine.footprint`` estimates its memory; a mode whose estimate does not fit the memory
available now is reported as such and not started (the machine is shared: an out-of-memory kill could hit someone
else's process). Each mode prints one JSON line: seconds per step (median after the warm-up), each phase's peak
resident memory on the largest rank (``perf/peak_mem_*``), the estimate, and the tokens per step.

    .venv/bin/python -m bench.real_size --shape qwen2.5-0.5b --modes lora,lora-no-ckpt,full --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.prepare import ensure_prepared
from bench.settings import OVERRIDES, PARAMS, WORK_DIR, paths

# 2 prompts x 4 samples of up to 16 tokens per step: small enough for minutes per mode on 2 cores
BASE = {**OVERRIDES, "ppo.train_batch_size": 2, "actor.ppo_mini_batch_size": 2, "rollout.n": 4,
        "task.max_response_length": 16, "actor.micro_batch_size": 8, "rollout.micro_batch_size": 8,
        "ppo.val_every": 0, "ppo.log_samples": 0, "ppo.save_every": 0}
MODES = {
    "lora": {"actor.lora.rank": 16, "actor.lora.alpha": 32.0, "actor.gradient_checkpointing": True, "actor.lr": 1e-3},
    "lora-no-ckpt": {"actor.lora.rank": 16, "actor.lora.alpha": 32.0, "actor.lr": 1e-3},
    "full": {},
}


def model_folder(shape: str):
    folder = WORK_DIR / f"init-{shape}"
    if not (folder / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "rlcore", "init-model", "--shape", shape, "--out", str(folder)],
                       check=True)
    return folder


def run_mode(shape: str, mode: str, steps: int, workers: int) -> dict:
    from rlcore.config import load_config
    from rlcore.data.collate import prompt_batch
    from rlcore.data.schema import read_rows
    from rlcore.engine import footprint
    from rlcore.engine.model import load_tokenizer
    from rlcore.trainer.round.modes import running_round

    folder = model_folder(shape)
    cfg = load_config(PARAMS, {**BASE, **MODES[mode], "resources.n_workers": workers, "model.path": str(folder)})
    estimate = footprint.estimates(cfg, folder, "ppo")[0]
    total, available = footprint.machine_bytes()
    need = estimate.per_rank * workers
    out = {"shape": shape, "mode": mode, "ranks": workers, "estimate_gib_per_rank": estimate.per_rank / 2**30,
           "estimate": estimate.describe(), "available_gib": available / 2**30, "total_gib": total / 2**30}
    if need > available:
        return {**out, "fits": False, "ran": False}
    tok = load_tokenizer(folder)
    data = paths()["rl_data"]
    prompts = prompt_batch(read_rows(data), tok, cfg.task.max_prompt_length, str(data))
    rows = []
    start = time.perf_counter()
    with running_round(cfg, init_dir=str(folder), tokenizer=tok, prompts=prompts, seed=1) as runner:
        setup_s = time.perf_counter() - start
        for step in range(steps):
            rows.append(runner.step(step))
    timed = rows[1:] or rows
    peaks = {k.removeprefix("perf/peak_mem_").removesuffix("_mib"): max(r.get(k, 0.0) for r in rows)
             for k in rows[0] if k.startswith("perf/peak_mem_")}
    return {**out, "fits": True, "ran": True, "setup_s": setup_s, "steps": steps,
            "s_per_step": statistics.median(r["timing_s/step"] for r in timed),
            "update_s": statistics.median(r["timing_s/update_actor"] for r in timed),
            "gen_s": statistics.median(r["timing_s/gen"] for r in timed),
            "peak_mib_per_phase": peaks, "response_length": statistics.mean(r["rollout/response_length"] for r in rows)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--modes", default="lora,lora-no-ckpt,full")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2, help="ranks (resources.n_workers)")
    args = ap.parse_args(argv)
    ensure_prepared()
    results = []
    for mode in args.modes.split(","):
        results.append(run_mode(args.shape, mode, args.steps, args.workers))
        print(json.dumps(results[-1]), flush=True)
    (WORK_DIR / f"real_size-{args.shape}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    main()
