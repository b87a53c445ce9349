"""The same SFT under other CPU kernel choices: does ``resources.cpu_kernels`` make the bits independent of them?

The tiny pipeline's SFT stage (``python -m stages.sft`` on ``prepare``'s data, the default params) runs four times in
one scratch copy of the repository, each with a private Ray:

* ``native`` in this machine's environment, and ``native`` in an environment that makes PyTorch, MKL and oneDNN
  choose other kernels, as another CPU model would (``ATEN_CPU_CAPABILITY=default``: PyTorch's non-AVX loops;
  ``MKL_CBWR=SSE4_2``: an SSE branch of MKL; ``ONEDNN_MAX_CPU_ISA=SSE41``);
* ``portable`` (the default) in the same two environments.

The table gives each run's model hash (sha256 of model.safetensors), its last loss and its wall time. If the two
``native`` runs differ and the two ``portable`` ones agree, the kernels chosen by the environment change the
result and the pin removes that dependence, in every process the stage starts (its own, the ranks', the scoring
ones).

    .venv/bin/python -m bench.kernels [--steps 2000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OTHER_CPU = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"}
RUNS = (("native", "this machine", {}), ("native", "other kernels", OTHER_CPU),
        ("portable", "this machine", {}), ("portable", "other kernels", OTHER_CPU))


def run(cmd: list[str], cwd: Path, env: dict) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="sft.steps (default: the default recipe's)")
    ap.add_argument("--keep", default=None, help="keep the scratch copy here")
    args = ap.parse_args(argv)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kernels-"))
    base = {k: v for k, v in os.environ.items() if k not in OTHER_CPU}
    env = {**base, "PATH": f"{Path(sys.executable).parent}:{base['PATH']}", "PYTHONPATH": str(root),
           "RAY_ADDRESS": "", "TQDM_DISABLE": "1"}
    try:
        root.mkdir(parents=True, exist_ok=True)
        for name in ("rlcore", "stages", "inputs"):
            shutil.copytree(REPO / name, root / name, dirs_exist_ok=True)
        rlcore = str(Path(sys.executable).parent / "rlcore")
        steps = [] if args.steps is None else ["--set", f"sft.steps={args.steps}"]
        run([rlcore, "config", "use", "--set", "tracking.enabled=false", *steps], root, env)
        run([sys.executable, "-m", "stages.prepare", "--inputs", "inputs/task", "--out-dir", "data/processed",
             "--metrics", "metrics/prepare.json"], root, env)
        rows = []
        for mode, where, extra in RUNS:
            run([rlcore, "config", "use", "--set", "tracking.enabled=false", *steps, "--set",
                 f"resources.cpu_kernels={mode}"], root, env)
            out = root / "models" / f"sft-{mode}-{where.replace(' ', '-')}"
            start = time.monotonic()
            run([sys.executable, "-m", "stages.sft", "--data", "data/processed/sft_train.parquet", "--out", str(out),
                 "--metrics", str(out) + ".json"], root, {**env, **extra})
            metrics = json.loads(Path(str(out) + ".json").read_text())
            digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()[:16]
            rows.append({"cpu_kernels": mode, "environment": where, "model sha256": digest,
                         "final loss": metrics["sft/final_loss"], "wall s": round(time.monotonic() - start, 1)})
            print(json.dumps(rows[-1]), flush=True)
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
        for r in rows:
            print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
