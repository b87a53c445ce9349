"""A/B of our side alone: rlcore as it is (A) against rlcore with config overrides, or another checkout of its
code (B).

Two ours children alternate in blocks, so each change is measured paired. ``--b-root DIR``: B runs the rlcore and
bench code of the checkout at DIR (``git worktree add DIR <commit>``) with the same configuration and prepared
data; its ranks load that code too (PYTHONPATH).

    .venv/bin/python -m bench.ab --ours-set resources.ref_reshard_after_forward=true
    .venv/bin/python -m bench.ab --ours-set resources.n_workers=1 --ours-set resources.cpus_per_worker=2
    .venv/bin/python -m bench.ab --steps 12      # no overrides: A/A, the noise floor
    .venv/bin/python -m bench.ab --config realistic --ours-set resources.cpu_kernels=native   # a bench config
    .venv/bin/python -m bench.ab --config realistic --b-root ../old    # this code (A) against another commit's (B)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from bench import report
from bench.children import Child, commit_of, other_checkout
from bench.monitor import LoadMeter
from bench.prepare import ensure_prepared
from bench.run_bench import alternate, ours_env, parse_sets, renice
from bench.settings import CONFIGS, FIXTURE_SET_ENV, REPO_ROOT, SET_ENV, WORK_DIR


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE", help="rlcore config for B")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--block", type=int, default=3)
    p.add_argument("--nice", type=int, default=None)
    p.add_argument("--quiet-wait", type=float, default=60.0)
    p.add_argument("--a-set", action="append", default=[], metavar="KEY=VALUE", help="rlcore config for A")
    p.add_argument("--b-root", default=None, metavar="DIR", help="B runs the rlcore checkout at DIR")
    p.add_argument("--config", default="default", choices=sorted(CONFIGS),
                   help="the benchmark configuration both sides run (make bench's names)")
    return p.parse_args(argv)


def phase_means(records: list[dict]) -> dict[str, float]:
    return {k: round(statistics.mean(r["phases"][k] for r in records), 4) for k in records[0]["phases"]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    renice(args.nice)
    sets, fixture = CONFIGS[args.config]
    os.environ[SET_ENV], os.environ[FIXTURE_SET_ENV] = json.dumps(sets), json.dumps(fixture)
    ensure_prepared()
    overrides = parse_sets(args.ours_set)
    a_overrides = parse_sets(args.a_set)
    envs = {"A": ours_env(a_overrides), "B": ours_env(overrides)}
    roots = {"A": None, "B": other_checkout(Path(args.b_root)) if args.b_root else None}
    if roots["B"] is not None:
        envs["B"]["PYTHONPATH"] = str(roots["B"])
    kids: dict[str, Child] = {}
    try:
        for name, env in envs.items():
            kids[name] = Child(f"ab_{name}", "bench.ours", env=env, cwd=roots[name])
            kids[name].expect("ready")
        for child in kids.values():
            child.run(args.warmup)
        measured, waited = alternate(kids, args.steps, args.block, LoadMeter([c.pid for c in kids.values()]),
                                     args.quiet_wait)
    finally:
        for child in kids.values():
            child.close()
    used, clean = report.choose_steps(measured)
    med = {n: statistics.median(r["wall_s"] for r in used[n]) for n in kids}
    b = {"overrides": overrides, **({"root": str(roots["B"]), "commit": commit_of(roots["B"])} if roots["B"] else {})}
    out = {"config": args.config, "A": {"overrides": a_overrides, "commit": commit_of(REPO_ROOT)}, "B": b,
           "clean_only": clean,
           "steps_used": {n: len(used[n]) for n in kids}, "median_s": med, "B_over_A": med["B"] / med["A"],
           "phases": {n: phase_means(used[n]) for n in kids}, "quiet_wait_s": waited}
    tag = "+".join(f"{k}={v}" for k, v in overrides.items()) or (f"code-{b['commit']}" if roots["B"] else "A-A")
    tag = "+".join(f"{k}={v}" for k, v in a_overrides.items()) + ("-vs-" if a_overrides else "") + tag
    (WORK_DIR / f"ab_{args.config}_{tag}.json").write_text(json.dumps({**out, "records": measured}, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
