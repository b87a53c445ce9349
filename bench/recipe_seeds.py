"""A recipe over seeds: the whole pipeline (`dvc repro`) once per seed, each in a scratch copy of the repository.

Each seed gets new data, a new SFT model (and reward model), a new RL round and the evaluation, with the recipe's
params file and ``seed`` changed, tracking off; the table has each seed's held-out greedy pass@1 of the SFT and
the final model, the gain, and the reward models' held-out pairwise accuracy where the recipe trains one.

    .venv/bin/python -m bench.recipe_seeds --params examples/rlhf.yaml --seeds 1,2,3 [--keep DIR] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
COPIED = ("rlcore", "stages", "inputs", "examples", "dvc.yaml")


def run_seed(params: dict, seed: int, root: Path) -> dict:
    """``dvc repro`` of ``params`` with ``seed`` in ``root`` (a fresh copy, or a kept one from a run that stopped:
    DVC skips the stages that finished there); the metrics that matter."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(root),
           "RAY_ADDRESS": "", "TQDM_DISABLE": "1"}
    if not (root / "dvc.yaml").exists():
        for name in COPIED:
            src = REPO / name
            (shutil.copytree if src.is_dir() else shutil.copy)(src, root / name)
        for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"]):
            subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True)
    (root / "params.yaml").write_text(yaml.safe_dump({**params, "seed": seed}, sort_keys=False))
    start = time.monotonic()
    proc = subprocess.run(["dvc", "repro"], cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"seed {seed}: dvc repro failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    ev = json.loads((root / "metrics" / "eval.json").read_text())
    out = {"seed": seed, "sft": ev["sft/greedy_pass@1"], "final": ev["final/greedy_pass@1"],
           "gain": ev["gain/greedy_pass@1"], "minutes": (time.monotonic() - start) / 60}
    for rm in sorted((root / "metrics").glob("rm_*.json")):
        out[f"{rm.stem} accuracy"] = json.loads(rm.read_text())["rm/test_accuracy"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", required=True, help="the recipe's params file")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override (YAML value)")
    ap.add_argument("--keep", default=None, help="keep each seed's copy under this folder")
    args = ap.parse_args(argv)
    from rlcore.config import apply_overrides

    params = yaml.safe_load(Path(args.params).read_text())
    params = apply_overrides(params, {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)})
    params.setdefault("tracking", {})["enabled"] = False
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        root = Path(args.keep) / f"seed{seed}" if args.keep else Path(tempfile.mkdtemp(prefix=f"recipe{seed}-"))
        root.mkdir(parents=True, exist_ok=True)
        try:
            rows.append(run_seed(params, seed, root))
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        print(json.dumps(rows[-1]), flush=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys) + " |")
    print(f"min gain {min(r['gain'] for r in rows):+.3f}, mean {sum(r['gain'] for r in rows) / len(rows):+.3f}")


if __name__ == "__main__":
    main()
