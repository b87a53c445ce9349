"""A recipe over seeds: the whole pipeline (`dvc repro`) once per seed, each in a scratch copy of the repository.

Each seed gets new data, a new SFT model (and reward model), a new RL round and the evaluation: params.yaml is
what `rlcore config use RECIPE --set seed=S` writes (tracking off); the table has each seed's held-out greedy
pass@1 of the SFT and the final model, the gain, and the reward models' held-out pairwise accuracy where the
recipe trains one.

    .venv/bin/python -m bench.recipe_seeds --recipe examples/rlhf.yaml --seeds 1,2,3 [--keep DIR] [--cache DIR]
        [--set KEY=VALUE] [--copy SRC=DEST] [--out FILE.json]

``--cache DIR``: one DVC cache for every copy (``dvc cache dir``), so a stage that another recipe already ran for
the same seed with the same code, inputs and params (the data, SFT and scoring of the recipes that change only the
RL step) is restored from DVC's run cache instead of run again. ``--keep DIR``: each seed's copy is kept there, and
a run stopped half way goes on where it stopped (DVC skips the stages that finished). ``--copy SRC=DEST``: a folder
copied into each seed's copy before it runs (a distillation teacher another pipeline trained:
``--copy models/ppo/r1=models/teacher`` after ``make run``).

Each row has the final round's wall seconds, steps per second and trained tokens per second (the response tokens
of every step's batch over the round's wall seconds) beside the held-out figures.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.machine import cpu_model
from rlcore.config import load_config

REPO = Path(__file__).resolve().parents[1]
COPIED = ("rlcore", "stages", "inputs", "examples", "dvc.yaml")


def provenance(root: Path) -> dict[str, str]:
    """When, where and with which code a seed ran: the ``measured`` and ``commit`` of its row (the figures pages
    print both under every table)."""
    kernels = load_config(root / "params.yaml").resources.cpu_kernels
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                             text=True).stdout.strip()
    return {"measured": f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core {cpu_model()}, {kernels} kernels",
            "commit": f"{head or 'unknown'}{' with uncommitted changes' if changed else ''}"}


def run_seed(recipes: list[str], sets: list[str], seed: int, root: Path, cache: Path | None,
             copies: Sequence[tuple[Path, str]] = ()) -> dict:
    """``dvc repro`` of the recipes (and ``--set`` values) with ``seed`` in ``root`` (a fresh copy, or a kept one
    from a run that stopped: DVC skips the stages that finished there); the metrics that matter."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(root),
           "RAY_ADDRESS": "", "TQDM_DISABLE": "1"}
    if not (root / "dvc.yaml").exists():
        for name in COPIED:
            src = REPO / name
            (shutil.copytree if src.is_dir() else shutil.copy)(src, root / name)
        for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"]):
            subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True)
        if cache is not None:
            subprocess.run(["dvc", "cache", "dir", "--local", str(cache.resolve())], cwd=root, env=env, check=True,
                           capture_output=True)
        for src, dest in copies:
            shutil.copytree(src, root / dest)
    use = [str(Path(sys.executable).parent / "rlcore"), "config", "use", *recipes, "--set", "tracking.enabled=false",
           *(f"--set={s}" for s in sets), "--set", f"seed={seed}"]
    subprocess.run(use, cwd=root, env=env, check=True, capture_output=True)
    start = time.monotonic()
    proc = subprocess.run(["dvc", "repro"], cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"seed {seed}: dvc repro failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    ev = json.loads((root / "metrics" / "eval.json").read_text())
    out = {"seed": seed, "sft": ev["sft/greedy_pass@1"], "final": ev["final/greedy_pass@1"],
           "gain": ev["gain/greedy_pass@1"], "minutes": (time.monotonic() - start) / 60, **provenance(root)}
    for key in ("agent/tool_calls_per_sample", "agent/error_observations", "agent/truncated_budget", "agent/failed",
                "agent/split"):
        if f"final/{key}" in ev:  # the agent loops' (tool, openai), in the evaluation of the final model
            out[f"final {key}"] = ev[f"final/{key}"]
    for rm in sorted((root / "metrics").glob("rm_*.json")):
        out[f"{rm.stem} accuracy"] = json.loads(rm.read_text())["rm/test_accuracy"]
    return {**out, **round_speed(root)}


def round_speed(root: Path) -> dict:
    """The final round's wall seconds, steps per second and trained tokens per second (every step's response tokens,
    from its plot rows: mean response length x kept groups x rollout.n)."""
    cfg = load_config(root / "params.yaml")
    final = cfg.evaluate.final_round
    wall = json.loads((root / "metrics" / f"ppo_{final}.json").read_text())["ppo/wall_s"]
    with (root / "plots" / f"ppo_{final}.csv").open() as f:
        rows = list(csv.DictReader(f))
    n = cfg.rollout.n
    tokens = sum(float(r["rollout/response_length"]) * float(r["rollout/groups_kept"]) * n for r in rows)
    return {"round_s": wall, "steps_per_s": len(rows) / wall, "trained_tokens_per_s": tokens / wall}


def folder_copy(text: str) -> tuple[Path, str]:
    """``--copy SRC=DEST``: an existing folder and where it goes in each seed's copy."""
    src, sep, dest = text.partition("=")
    if not sep or not dest or not Path(src).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: expected SRC=DEST with SRC an existing folder")
    return Path(src).resolve(), dest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", action="append", required=True, metavar="FILE",
                    help="a recipe (examples/*.yaml), relative to the repository; repeatable, applied in order")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override (YAML value)")
    ap.add_argument("--keep", default=None, help="keep each seed's copy under this folder")
    ap.add_argument("--cache", default=None, help="one DVC cache for every copy (its run cache shares stages)")
    ap.add_argument("--copy", action="append", default=[], type=folder_copy, metavar="SRC=DEST",
                    help="a folder copied into each seed's copy (DEST relative to it) before it runs")
    ap.add_argument("--out", default=None, metavar="FILE.json",
                    help="add each seed's row to this file under the recipe's name (a seed already there is skipped)")
    args = ap.parse_args(argv)
    from rlcore.commands.common import parse_overrides
    from rlcore.recipes import compose

    compose([REPO / r for r in args.recipe], parse_overrides(args.set))  # a bad recipe stops here, in one line
    cache = Path(args.cache) if args.cache else None
    name = " + ".join(Path(r).stem for r in args.recipe) + "".join(f" --set {s}" for s in args.set)
    out = Path(args.out) if args.out else None
    done = json.loads(out.read_text()) if out is not None and out.is_file() else {}
    rows = [r for r in done.get(name, []) if str(r["seed"]) in args.seeds.split(",")]
    for seed in (int(s) for s in args.seeds.split(",")):
        if any(r["seed"] == seed for r in rows):
            continue
        root = Path(args.keep) / f"seed{seed}" if args.keep else Path(tempfile.mkdtemp(prefix=f"recipe{seed}-"))
        root.mkdir(parents=True, exist_ok=True)
        try:
            rows.append(run_seed(args.recipe, args.set, seed, root, cache, args.copy))
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(rows[-1]), flush=True)
        if out is not None:
            done = json.loads(out.read_text()) if out.is_file() else {}
            done[name] = sorted([r for r in done.get(name, []) if r["seed"] != seed] + [rows[-1]],
                                key=lambda r: r["seed"])
            out.write_text(json.dumps(done, indent=1) + "\n")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys) + " |")
    print(f"min gain {min(r['gain'] for r in rows):+.3f}, mean {sum(r['gain'] for r in rows) / len(rows):+.3f}")


if __name__ == "__main__":
    main()
