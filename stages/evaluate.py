"""evaluate: greedy pass@1 and sampled pass@k on the held-out test split, SFT vs the final round.

    python -m stages.evaluate --data data/processed/test.parquet --rewards inputs/reward --tools inputs/tools \
        --sft models/sft --final models/ppo/r1 --metrics metrics/eval.json --samples metrics/eval_samples.csv \
        --problems metrics/eval_problems.csv

Its MLflow run carries every params.yaml key, so pipeline runs compare side by side.
"""

from __future__ import annotations

import csv
from pathlib import Path

from rlcore.stage.frame import parser, require_file, stage_errors, write_json
from rlcore.config import Config
from rlcore.heap import long_lived, script
from rlcore.stage.run import stage_run, stage_setup

PARAMS = tuple(Config.model_fields)  # all of params.yaml: they label the pipeline run in MLflow


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, rewards=True, tools=True)
    p.add_argument("--data", required=True)
    p.add_argument("--sft", required=True)
    p.add_argument("--final", required=True)
    p.add_argument("--samples", required=True, help="CSV of sample prompts, responses and rewards")
    p.add_argument("--problems", required=True,
                   help="CSV of each test problem's greedy correctness (1/0) per model, in the test split's order")
    args = p.parse_args(argv)
    with stage_errors("evaluate"):
        cfg, params = stage_setup(args, PARAMS, "evaluate")
        for path, what in ((args.data, "test data"), (args.sft, "SFT model"), (args.final, "final model")):
            require_file(path, what)
        # heavy imports (torch, transformers, ray) only after the params are known to be valid; what they load
        # lives to the end of the process (rlcore.heap)
        with long_lived():
            from rlcore.engine.model import load_tokenizer
            from rlcore.trainer.evaluate import run_evaluate
            tokenizer = load_tokenizer(args.sft)
        with stage_run(cfg, args, "evaluate", params) as tracker:
            metrics, table, problems = run_evaluate(cfg, models={"sft": args.sft, "final": args.final},
                                                    tokenizer=tokenizer, data_path=args.data)
            write_json(args.metrics, metrics)
            write_table(args.samples, table)
            write_table(args.problems, per_problem(problems))
            tracker.log_final(metrics)
            tracker.log_table(table, "eval_samples.json")


def write_table(path: str, table: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]) if table else ["model"])
        w.writeheader()
        w.writerows(table)


def per_problem(correct: dict[str, list[int]]) -> list[dict]:
    """Rows ``{problem, <model>: 1 or 0, ...}``, one per test problem (its row in the test split)."""
    return [{"problem": i, **{name: marks[i] for name, marks in correct.items()}}
            for i in range(len(next(iter(correct.values()), [])))]


if __name__ == "__main__":
    script(main)
