"""The same SFT under everything that differs between real CPUs: does ``resources.cpu_kernels: portable`` give one
model whatever the CPU, and does ``native`` not?

The tiny pipeline's SFT stage (``python -m stages.sft`` on ``prepare``'s data, the default params) runs in one scratch
copy of the repository, each run with a private Ray, once per row:

* ``portable`` on this machine; with the AVX2 product kernel and with the scalar one instead of the best this CPU
  has (``RLCORE_PORTABLE_ISA``: what an AVX2-only CPU and a CPU without AVX2 run); in an environment that makes
  PyTorch, MKL and oneDNN choose another CPU's code (``ATEN_CPU_CAPABILITY=default``, ``MKL_CBWR=SSE4_2``,
  ``ONEDNN_MAX_CPU_ISA=SSE41``) and in one that asks for their AVX-512 code (``ATEN_CPU_CAPABILITY=avx512``,
  ``MKL_CBWR=AVX512``); with two threads per rank (``resources.cpus_per_worker=2``). The portable products'
  blocking (what a CPU's cache sizes would choose) is shown not to matter by tests/engine/test_portable_ops.py.
* ``native`` on this machine and in the other CPU's environment.

The table gives each run's model hash (sha256 of model.safetensors), its last loss and its wall time: one hash for
every ``portable`` row, and another for each ``native`` row, is the claim.

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
WIDEST = {"ATEN_CPU_CAPABILITY": "avx512", "MKL_CBWR": "AVX512"}
# (cpu_kernels, what differs, environment, params)
RUNS = (
    ("portable", "this machine", {}, []),
    ("portable", "AVX2 product kernel", {"RLCORE_PORTABLE_ISA": "avx2"}, []),
    ("portable", "scalar product kernel", {"RLCORE_PORTABLE_ISA": "scalar"}, []),
    ("portable", "another CPU's PyTorch, MKL, oneDNN code", OTHER_CPU, []),
    ("portable", "their AVX-512 code", WIDEST, []),
    ("portable", "2 threads per rank", {}, ["resources.cpus_per_worker=2", "ray.num_cpus=4"]),
    ("native", "this machine", {}, []),
    ("native", "another CPU's PyTorch, MKL, oneDNN code", OTHER_CPU, []),
)
ENV_KEYS = {k for _, _, env, _ in RUNS for k in env}


def run(cmd: list[str], cwd: Path, env: dict) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="sft.steps (default: the default recipe's)")
    ap.add_argument("--keep", default=None, help="keep the scratch copy here")
    args = ap.parse_args(argv)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kernels-"))
    base = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
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
        for i, (mode, where, extra, sets) in enumerate(RUNS):
            run([rlcore, "config", "use", "--set", "tracking.enabled=false", *steps, "--set",
                 f"resources.cpu_kernels={mode}", *(a for s in sets for a in ("--set", s))], root, env)
            out = root / "models" / f"sft-{i}-{mode}"
            start = time.monotonic()
            run([sys.executable, "-m", "stages.sft", "--data", "data/processed/sft_train.parquet", "--out", str(out),
                 "--metrics", str(out) + ".json"], root, {**env, **extra})
            metrics = json.loads(Path(str(out) + ".json").read_text())
            digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()[:16]
            rows.append({"cpu_kernels": mode, "what differs": where, "model sha256": digest,
                         "final loss": metrics["sft/final_loss"], "wall s": round(time.monotonic() - start, 1)})
            print(json.dumps(rows[-1]), flush=True)
        print(table(rows))
        return rows
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
