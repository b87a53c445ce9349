"""Synchronous vs asynchronous PPO rounds on the same CPUs and the same number of samples (``make bench-async``).

For each workload (the project's defaults, and a long-tailed one where ``task.long_tail_frac`` of the problems
ask for an answer ``task.long_tail_length`` characters longer) this builds the benchmark's SFT fixture
(``bench.prepare``), then runs the same round twice from it, each on ``ray.num_cpus`` (2) CPUs:

* sync: ``resources.n_workers`` 2 ranks of 1 CPU, each generating half the step's batch, then training on it;
* async: the trainer's 2 ranks on half a CPU each and 1 generator on 1 CPU (``rollout.n_workers``; one torch
  thread each, so three threads share the two cores), ``ppo.async.max_staleness`` 1 and the truncated-IS
  correction: the generator samples the next batch while the trainer trains.

Both take ``--steps`` steps of ``ppo.train_batch_size`` x ``rollout.n`` samples from the same prompts and seed.
Samples per second are over the steps after the first (start-up and warm-up excluded); the
held-out greedy pass@1 on the test split is taken before the first and after the last step. It prints
``async/sync samples per second: X`` for each workload, the reward against wall-clock time of both modes,
writes ``bench/_work/async/<workload>_<mode>.csv`` (every step's metrics) and the calibration the discrete-event
simulation reads (``bench/_work/async/calibration.json``), then runs ``bench.weight_sync`` (the weight hand-off:
object store vs gloo) and ``bench.async_sim`` (sync vs async at 8-64 GPUs, calibrated with these runs) and
writes all three into its section of ``bench/RESULTS.md``.

    .venv/bin/python -m bench.async_bench [--steps 150] [--workloads default,long-tail] [--out bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TQDM_DISABLE", "1")

import ray

from bench.sections import write_section
from bench.settings import BENCH_DIR, RL_SEED, SET_ENV, WORK_DIR, paths, rl_config

SECTION = "async"
# The first step of a round waits for its processes to warm up (an async round's first batch also waits for the
# generator's process to start): both modes' samples/s are over the steps after it.
WARMUP_STEPS = 1
OUT_DIR = WORK_DIR / "async"
ROOT = BENCH_DIR.parent
# The long-tailed workload: one problem in 8 asks for 24 filler characters before its number, so a step's
# batch (32 prompts) almost surely holds some and its longest answer is ~8x the others.
WORKLOADS: dict[str, dict] = {
    "default": {},
    "long-tail": {"task.long_tail_frac": 0.125, "task.long_tail_length": 24, "task.max_response_length": 32},
}
MODES: dict[str, dict] = {
    "sync": {"ppo.mode": "sync", "resources.n_workers": 2},
    "async": {"ppo.mode": "async", "resources.n_workers": 2, "resources.cpus_per_worker": 0.5, "rollout.n_workers": 1,
              "rollout.cpus_per_worker": 1, "ppo.async.max_staleness": 1, "actor.off_policy.correction": "tis"},
}


def run_mode(workload: str, mode: str, steps: int) -> dict:
    """One round of ``steps`` steps; its per-step rows and summary."""
    from rlcore.engine.model import load_tokenizer
    from rlcore.tracking import NullTracker
    from rlcore.trainer.ppo import run_ppo_round

    p = paths()
    sets = {**MODES[mode], "ppo.save_every": 0, "ppo.log_samples": 0, "ppo.val_every": steps, "seed": RL_SEED,
            "ppo.rounds": {"bench": {"init": str(p["sft"]), "steps": steps}}, "evaluate.final_round": "bench"}
    cfg = rl_config(sets)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    plot = OUT_DIR / f"{workload}_{mode}.csv"
    plot.unlink(missing_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        summary = run_ppo_round(cfg, round_name="bench", init_dir=str(p["sft"]), tokenizer=load_tokenizer(p["sft"]),
                                data_path=str(p["rl_data"]), out_dir=out, tracker=NullTracker(), plot_csv=str(plot),
                                val_path=str(p["data"] / "test.parquet"))
    wall = time.perf_counter() - start
    rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(plot.open())]
    step_s = [r["timing_s/step"] for r in rows[WARMUP_STEPS:]]
    samples = cfg.ppo.train_batch_size * cfg.rollout.n
    return {"rows": rows, "samples_per_step": samples, "steps_s": sum(step_s), "median_step_s": statistics.median(step_s),
            "samples_per_s": samples * len(step_s) / sum(step_s), "wall_s": wall, "summary": summary,
            "val_first": summary.get("ppo/val_greedy_pass@1_first"), "val_last": summary.get("ppo/val_greedy_pass@1_last"),
            "response_length": statistics.mean(r["rollout/response_length"] for r in rows),
            "gen_s_median": statistics.median(r.get("timing_s/gen", 0.0) for r in rows),
            **{f"{k}_median": statistics.median(r.get(k, 0.0) for r in rows[WARMUP_STEPS:])
               for k in ("timing_s/publish", "async/generator_idle_frac", "async/trainer_idle_frac")},
            # each step trains on one batch of one policy version: the mean over steps is the mean over samples
            "async/staleness_mean": statistics.mean(r.get("async/staleness", 0.0) for r in rows[WARMUP_STEPS:]),
            "update_s_median": statistics.median(r.get("timing_s/update_actor", 0.0) for r in rows)}


def curve(rows: list[dict], points: int = 6) -> list[tuple[float, float, int]]:
    """(seconds since the first step started, mean reward of the steps so far in that tenth, step) at
    ``points`` evenly spaced steps: the reward against wall-clock time."""
    out, t = [], 0.0
    marks = {round(i * (len(rows) - 1) / (points - 1)) for i in range(points)}
    window: list[float] = []
    for i, r in enumerate(rows):
        t += r["timing_s/step"]
        window.append(r["rollout/acc"])
        if i in marks:
            out.append((t, statistics.mean(window), i + 1))
            window = []
    return out


def report(results: dict[str, dict[str, dict]], steps: int) -> str:
    lines = ["## Asynchronous vs synchronous rounds (`make bench-async`)", "",
             (f"Same 2 CPUs, same samples ({steps} steps x 32 prompts x 8), same prompts and seed; samples/s over the "
             f"steps after the first (start-up and warm-up excluded). sync: 2 ranks generate then train. async: 2 trainer ranks on half a CPU each + 1 generator on 1 CPU, "
             f"max_staleness 1, truncated IS. Held-out: greedy pass@1 on the 256 test prompts after the last step."),
             "", ("| workload | mode | samples/s | median step s | gen s (median) | update s (median) | "
                  "mean response length | held-out before -> after |"), "|---|---|---|---|---|---|---|---|"]
    for w, by_mode in results.items():
        for mode, r in by_mode.items():
            lines.append(f"| {w} | {mode} | {r['samples_per_s']:.0f} | {r['median_step_s']:.3f} | {r['gen_s_median']:.3f} "
                         f"| {r['update_s_median']:.3f} | {r['response_length']:.1f} | "
                         f"{r['val_first']:.3f} -> {r['val_last']:.3f} |")
    lines += ["", "Ratios:", ""]
    for w, by_mode in results.items():
        lines.append(f"- {w}: async/sync samples per second: {ratio(by_mode):.2f}")
    lines += ["", "Reward (rollout accuracy over each stretch) against seconds of training:", ""]
    for w, by_mode in results.items():
        for mode, r in by_mode.items():
            pts = ", ".join(f"{t:.0f}s {acc:.3f}" for t, acc, _ in curve(r["rows"]))
            lines.append(f"- {w} {mode}: {pts}")
    return "\n".join(lines) + "\n"


def ratio(by_mode: dict[str, dict]) -> float:
    return by_mode["async"]["samples_per_s"] / by_mode["sync"]["samples_per_s"]


def calibration(results: dict[str, dict[str, dict]]) -> dict:
    """What the simulation (``bench.async_sim``) is calibrated with: the measured per-step generation and
    training seconds, the response lengths, and the measured throughputs it should reproduce."""
    out = {}
    for w, by_mode in results.items():
        s = by_mode["sync"]
        out[w] = {"samples_per_step": s["samples_per_step"], "sync_gen_s": s["gen_s_median"],
                  "sync_update_s": s["update_s_median"], "sync_step_s": s["median_step_s"],
                  "async_step_s": by_mode["async"]["median_step_s"], "mean_response_length": s["response_length"],
                  "sync_samples_per_s": s["samples_per_s"], "async_samples_per_s": by_mode["async"]["samples_per_s"],
                  "measured_async_over_sync": ratio(by_mode),
                  # the trainer's weight publish (put into the object store) per step, and what the async run saw
                  "weight_sync_s": by_mode["async"]["timing_s/publish_median"],
                  "async_generator_idle_frac": by_mode["async"]["async/generator_idle_frac_median"],
                  "async_trainer_idle_frac": by_mode["async"]["async/trainer_idle_frac_median"],
                  "async_staleness_mean": by_mode["async"]["async/staleness_mean"]}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150, help="RL steps per run (default 150)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--out", default=str(BENCH_DIR / "RESULTS.md"), help="the report's file (its own section)")
    ap.add_argument("--no-weight-sync", dest="weight_sync", action="store_false",
                    help="skip the weight hand-off measurement (bench.weight_sync, about 70 s)")
    ap.add_argument("--no-sim", dest="sim", action="store_false", help="skip the simulation (bench.async_sim)")
    args = ap.parse_args(argv)
    from bench.prepare import ensure_prepared

    results: dict[str, dict[str, dict]] = {}
    for w in args.workloads.split(","):
        if w not in WORKLOADS:
            raise SystemExit(f"--workloads: unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
        os.environ[SET_ENV] = json.dumps(WORKLOADS[w])
        print(f"[{w}] fixture: {ensure_prepared()['sft_metrics']}", flush=True)
        results[w] = {}
        for mode in MODES:
            results[w][mode] = r = run_mode(w, mode, args.steps)
            print(f"[{w}] {mode}: {r['samples_per_s']:.0f} samples/s, median step {r['median_step_s']:.3f}s, held-out "
                  f"{r['val_first']:.3f} -> {r['val_last']:.3f}", flush=True)
        print(f"[{w}] async/sync samples per second: {ratio(results[w]):.2f}", flush=True)
    (OUT_DIR / "calibration.json").write_text(json.dumps(calibration(results), indent=2))
    text = report(results, args.steps)
    ray.shutdown()  # the other two benchmarks start their own
    for flag, title, cmd in (
            (args.weight_sync, "Weight hand-off, Ray object store vs gloo broadcast (`python -m bench.weight_sync`)",
             ["-m", "bench.weight_sync"]),
            (args.sim, "Discrete-event simulation at 8-64 GPUs, calibrated with the runs above "
             "(`python -m bench.async_sim --calibration bench/_work/async/calibration.json`)",
             ["-m", "bench.async_sim", "--calibration", str((OUT_DIR / "calibration.json").relative_to(ROOT))])):
        if flag:  # from the repository's root, so that the report names its files as a reader's checkout does
            out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, check=True, cwd=ROOT).stdout
            text += f"\n### {title}\n\n```\n{out.strip()}\n```\n"
    print(text)
    write_section(args.out, SECTION, text)
    default = results.get("default") or next(iter(results.values()))
    print(f"async/sync samples per second: {ratio(default):.2f}")


if __name__ == "__main__":
    main()
