"""score: sample the SFT policy on the RL prompts, score them with the reward, filter trivial prompts.

    python -m stages.score --model models/sft --data data/processed/rl_train.parquet --rewards inputs/reward --tools inputs/tools \
        --out data/scored/rl_train.parquet --metrics metrics/score.json

``--rewards`` holds the manifests of the reward files and reward model (dvc.yaml's reward_file and rm stages).
"""

from __future__ import annotations

from rlcore.stage.frame import parser, require_file, stage_errors, write_json
from rlcore.heap import long_lived, script
from rlcore.stage.run import stage_run, stage_setup

PARAMS = ("seed", "ray", "tracking", "model", "task.max_prompt_length", "task.max_response_length", "resources",
          "rollout", "reward", "score")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, rewards=True, tools=True)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with stage_errors("score"):
        cfg, params = stage_setup(args, PARAMS, "score")
        require_file(args.data, "rl data")
        require_file(args.model, "SFT model")
        # heavy imports (torch, transformers, ray) only after the params are known to be valid; what they load
        # lives to the end of the process (rlcore.heap)
        with long_lived():
            from rlcore.engine.model import load_tokenizer
            from rlcore.trainer.score import run_score
            tokenizer = load_tokenizer(args.model)
        with stage_run(cfg, args, "score", params) as tracker:
            metrics = run_score(cfg, model_dir=args.model, tokenizer=tokenizer, data_path=args.data,
                                out_path=args.out)
            write_json(args.metrics, metrics)
            tracker.log_final(metrics)


if __name__ == "__main__":
    script(main)
