"""What scoring costs in a PPO step (``make bench-reward``): the reward functions' share of the step.

From the benchmark's SFT fixture (``bench.prepare``), the same round (``--steps`` steps, 32 prompts x 8 responses,
the project's defaults otherwise) runs once per configuration below, on the same 2 CPUs; each reports the median
over its steps (the first excluded) of ``timing_s/reward`` (decoding the responses and scoring them with every
function, in the scoring processes) and of ``timing_s/step``, and their ratio:

* rule: the built-in rule alone (the default pipeline);
* rule + 2 functions: two user functions from a file (``bench/reward_fns.py``: a format check and a length
  penalty with an extra value), with the default ``reward.processes`` (2) and with 1;
* slow function: one that waits 2 ms per sample, plain with 1 and 2 processes, and ``async def`` with 1.

    .venv/bin/python -m bench.reward_cost [--steps 40] [--out bench/RESULTS.md]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile

os.environ.setdefault("TQDM_DISABLE", "1")

from bench.sections import write_section
from bench.settings import BENCH_DIR, RL_SEED, WORK_DIR, paths, rl_config

SECTION = "reward-cost"
FNS = str(BENCH_DIR / "reward_fns.py")
TWO = [{"path": FNS, "name": "format_ok", "weight": 0.1}, {"path": FNS, "name": "brevity", "weight": 0.1}]
CONFIGS: dict[str, dict] = {
    "rule (default)": {},
    "rule + 2 functions, 2 processes (default)": {"reward.functions": TWO},
    "rule + 2 functions, 1 process": {"reward.functions": TWO, "reward.processes": 1},
    "rule + slow function, 1 process": {"reward.functions": [{"path": FNS, "name": "slow", "weight": 0.0}],
                                        "reward.processes": 1},
    "rule + slow function, 2 processes": {"reward.functions": [{"path": FNS, "name": "slow", "weight": 0.0}]},
    "rule + slow async function, 1 process": {"reward.functions": [{"path": FNS, "name": "slow_async", "weight": 0.0}],
                                              "reward.processes": 1},
}


def run(name: str, steps: int) -> dict:
    from rlcore.engine.model import load_tokenizer
    from rlcore.tracking import NullTracker
    from rlcore.trainer.ppo import run_ppo_round

    p = paths()
    cfg = rl_config({**CONFIGS[name], "ppo.save_every": 0, "ppo.log_samples": 0, "ppo.val_every": 0, "seed": RL_SEED,
                     "ppo.rounds": {"bench": {"init": str(p["sft"]), "steps": steps}}, "evaluate.final_round": "bench"})
    plot = WORK_DIR / "reward_cost.csv"
    with tempfile.TemporaryDirectory() as out:
        run_ppo_round(cfg, round_name="bench", init_dir=str(p["sft"]), tokenizer=load_tokenizer(p["sft"]),
                      data_path=str(p["rl_data"]), out_dir=out, tracker=NullTracker(), plot_csv=str(plot))
    rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(plot.open())][1:]
    reward = statistics.median(r["timing_s/reward"] for r in rows)
    step = statistics.median(r["timing_s/step"] for r in rows)
    return {"reward_ms": reward * 1000, "step_ms": step * 1000, "share": reward / step}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="RL steps per configuration (default 40)")
    ap.add_argument("--out", default=str(BENCH_DIR / "RESULTS.md"), help="the report's file (its own section)")
    args = ap.parse_args(argv)
    from bench.prepare import ensure_prepared

    print(f"fixture: {ensure_prepared()['sft_metrics']}", flush=True)
    lines = ["## What scoring costs in a PPO step (`make bench-reward`)", "",
             f"Median over {args.steps - 1} steps (the first excluded) of 32 prompts x 8 responses, 2 CPUs, the "
             "benchmark's SFT fixture; reward = decoding + every reward function in the scoring processes.", "",
             "| configuration | reward ms | step ms | reward / step |", "|---|---|---|---|"]
    for name in CONFIGS:
        r = run(name, args.steps)
        print(f"{name}: reward {r['reward_ms']:.2f} ms of a {r['step_ms']:.1f} ms step ({r['share']:.1%})", flush=True)
        lines.append(f"| {name} | {r['reward_ms']:.2f} | {r['step_ms']:.1f} | {r['share']:.1%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_section(args.out, SECTION, text)


if __name__ == "__main__":
    main()
