"""rm@<name>: train a Bradley-Terry reward model on preference pairs (rm.models.<name>), for reward.model.

    python -m stages.rm --name rm --train data/processed/pairs_train.parquet \
        --test data/processed/pairs_test.parquet --init models/sft --out models/rm/rm \
        --manifest inputs/reward/rm_rm.json --metrics metrics/rm_rm.json --plots plots/rm_rm.csv

``--manifest`` records the trained model by sha256 (rlcore.inputs), so the stages that score with it re-run when
it changes.
"""

from __future__ import annotations

from rlcore.stage.frame import REPO_ROOT, parser, require_file, stage_errors, write_json
from rlcore.errors import ConfigError
from rlcore.heap import long_lived, script
from rlcore.stage.run import stage_run, stage_setup

PARAMS = ("seed", "ray", "tracking", "model", "task.max_prompt_length", "task.max_response_length", "resources", "rm",
          "checkpoint")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--name", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--test", required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--manifest", required=True)
    p.add_argument("--plots", default=None)
    args = p.parse_args(argv)
    with stage_errors(f"rm@{args.name}"):
        cfg, params = stage_setup(args, PARAMS, "rm")
        if args.name not in cfg.rm.models:
            raise ConfigError(f"--name {args.name!r} is not a key of rm.models ({', '.join(cfg.rm.models) or 'none'})")
        for path, what in ((args.train, "training pairs"), (args.test, "held-out pairs"), (args.init, "initial model")):
            require_file(path, what)
        # heavy imports (torch, transformers, ray) only after the params are known to be valid; what they load
        # lives to the end of the process (rlcore.heap)
        with long_lived():
            from rlcore.engine.model import load_tokenizer
            from rlcore.inputs import write_manifest
            from rlcore.trainer.loop.checkpoint import stage_checkpoints
            from rlcore.trainer.rm import run_rm
            tokenizer = load_tokenizer(args.init)
        # the model's checkpoints depend on its own entry of rm.models, not on the other reward models
        own = {**params, "rm": {**params["rm"], "models": {args.name: params["rm"]["models"][args.name]}}}
        checkpoints = stage_checkpoints(cfg, stage=f"rm@{args.name}", save_every=cfg.rm.save_every, params=own,
                                        root=REPO_ROOT, inputs=[args.train, args.test, args.init])
        resume = checkpoints.resume()
        with stage_run(cfg, args, "rm", own, round_name=args.name, run_id=resume.run_id if resume else None) as tracker:
            metrics = run_rm(cfg, init=args.init, tokenizer=tokenizer, train_path=args.train, test_path=args.test,
                             out_dir=args.out, tracker=tracker, plot_csv=args.plots,
                             self_play=cfg.rm.models[args.name].self_play, checkpoints=checkpoints, resume=resume)
            write_json(args.metrics, metrics)
            tracker.log_final(metrics, prefix=f"{args.name}/")
        write_manifest(args.out, args.manifest)
        checkpoints.finish()


if __name__ == "__main__":
    script(main)
