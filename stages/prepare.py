"""prepare: build the task's sft_train / rl_train / test splits as parquet.

    python -m stages.prepare --out-dir data/processed --metrics metrics/prepare.json
"""

from __future__ import annotations

from pathlib import Path

from rlcore.cli import parser, stage_config, stage_errors, write_json
from rlcore.data.schema import write_rows
from rlcore.data.splits import build_splits

PARAMS = ("seed", "task")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    with stage_errors("prepare"):
        cfg, _ = stage_config(args.params, PARAMS, "prepare")
        t = cfg.task
        splits = build_splits(task=t.name, seed=cfg.seed, n_sft=t.n_sft, n_rl=t.n_rl, n_test=t.n_test,
                              min_digits=t.min_digits, max_digits=t.max_digits, ops=tuple(t.ops),
                              gsm8k_train_path=t.gsm8k_train_path, gsm8k_test_path=t.gsm8k_test_path,
                              sft_carry_error_rate=t.sft_carry_error_rate)
        for name, rows in splits.items():
            write_rows(rows, Path(args.out_dir) / f"{name}.parquet")
    metrics = {f"prepare/{name}_rows": len(rows) for name, rows in splits.items()}
    wrong = sum(r["extra_info"]["answer"] != r["reward_model"]["ground_truth"] for r in splits["sft_train"])
    metrics["prepare/sft_wrong_demonstrations"] = wrong
    write_json(args.metrics, metrics)


if __name__ == "__main__":
    main()
