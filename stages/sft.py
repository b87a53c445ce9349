"""sft: supervised fine-tuning of the base model (built-in tiny or a local HF folder) on Ray workers (DDP or FSDP2).

    python -m stages.sft --data data/processed/sft_train.parquet --tools inputs/tools --out models/sft \
        --metrics metrics/sft.json --plots plots/sft.csv

With the tool loop (``rollout.agent``), prompts show the tools' schemas to chat templates that take them, and
multi-turn demonstrations (``extra_info.messages``) are trained on their assistant turns only.
"""

from __future__ import annotations

from rlcore.stage.frame import REPO_ROOT, parser, require_file, stage_errors, write_json
from rlcore.heap import long_lived, script
from rlcore.stage.run import stage_run, stage_setup

PARAMS = ("seed", "ray", "tracking", "model", "task.max_prompt_length", "task.max_response_length", "resources",
          "sft", "checkpoint", "rollout.agent.loop", "rollout.agent.tools")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, tools=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--plots", default=None)
    args = p.parse_args(argv)
    with stage_errors("sft"):
        cfg, params = stage_setup(args, PARAMS, "sft")
        require_file(args.data, "sft data")
        # heavy imports (torch, transformers, ray) only after the params are known to be valid; what they load
        # lives to the end of the process (rlcore.heap)
        with long_lived():
            from rlcore.engine.model import load_tokenizer, resolve_model_path
            from rlcore.trainer.loop.checkpoint import stage_checkpoints
            from rlcore.trainer.sft import run_sft
            base = resolve_model_path(cfg.model.path, tiny_shape=cfg.model.tiny.model_dump(), seed=cfg.seed)
            tokenizer = load_tokenizer(base)
        checkpoints = stage_checkpoints(cfg, stage="sft", save_every=cfg.sft.save_every, params=params, root=REPO_ROOT,
                                        inputs=[args.data, base])
        resume = checkpoints.resume()
        with stage_run(cfg, args, "sft", params, run_id=resume.run_id if resume else None) as tracker:
            metrics = run_sft(cfg, base_model=base, tokenizer=tokenizer, data_path=args.data, out_dir=args.out,
                              tracker=tracker, plot_csv=args.plots, checkpoints=checkpoints, resume=resume)
            write_json(args.metrics, metrics)
            tracker.log_final(metrics)
        checkpoints.finish()


if __name__ == "__main__":
    script(main)
