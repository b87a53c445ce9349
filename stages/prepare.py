"""prepare: build the task's sft_train / rl_train / test splits as parquet.

    python -m stages.prepare --inputs inputs/task --out-dir data/processed --metrics metrics/prepare.json

``--inputs`` holds the manifests of the task's files (``task.file``; dvc.yaml's task_file stages write them).
"""

from __future__ import annotations

from rlcore.stage.frame import parser, stage_config, stage_errors, write_json
from rlcore.heap import script

PARAMS = ("seed", "task")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--inputs", required=True, help="folder of the task files' manifests (rlcore.inputs)")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    with stage_errors("prepare"):
        cfg, _ = stage_config(args.params, PARAMS, "prepare")
        from rlcore.trainer.prepare import check_task_files, write_splits  # pandas, pyarrow once the params are valid

        check_task_files(cfg, args.inputs)
        metrics = write_splits(cfg, args.out_dir)
        write_json(args.metrics, metrics)


if __name__ == "__main__":
    script(main)
