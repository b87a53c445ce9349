"""prepare: build the task's sft_train / rl_train / test splits as parquet.

    python -m stages.prepare --out-dir data/processed --metrics metrics/prepare.json
"""

from __future__ import annotations

from rlcore.cli import parser, stage_config, stage_errors, write_json

PARAMS = ("seed", "task")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    with stage_errors("prepare"):
        cfg, _ = stage_config(args.params, PARAMS, "prepare")
        from rlcore.trainer.prepare import write_splits  # pandas and pyarrow only once the params are valid

        metrics = write_splits(cfg, args.out_dir)
        write_json(args.metrics, metrics)


if __name__ == "__main__":
    main()
