"""ppo@<round>: one RL round (estimator, losses and KL from params.yaml) from the previous model.

    python -m stages.ppo --round r1 --init models/sft --teacher models/sft --data data/scored/rl_train.parquet \
        --rewards inputs/reward --tools inputs/tools --out models/ppo/r1 --metrics metrics/ppo_r1.json --plots plots/ppo_r1.csv \
        --val-data data/processed/test.parquet --rollouts metrics/ppo_r1_rollouts.parquet
"""

from __future__ import annotations

from rlcore.stage.frame import REPO_ROOT, parser, require_file, stage_errors, write_json
from rlcore.errors import ConfigError
from rlcore.names import TEACHER_ESTIMATORS
from rlcore.heap import long_lived, script
from rlcore.stage.run import stage_run, stage_setup

PARAMS = ("seed", "ray", "tracking", "model", "task.max_prompt_length", "task.max_response_length", "resources",
          "rollout", "reward", "algorithm", "distill", "actor", "critic",
          "ppo", "checkpoint")


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__, rewards=True, tools=True)
    p.add_argument("--round", required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--teacher", default=None, help="distill.teacher, a dependency of the round (read only when the "
                   "estimator takes a teacher; default: the params' own)")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--plots", default=None)
    p.add_argument("--val-data", default=None, help="held-out prompts for ppo.val_every (reported only)")
    p.add_argument("--rollouts", default=None,
                   help="parquet of the ppo.log_samples rollouts of every step (rewritten after each step)")
    args = p.parse_args(argv)
    with stage_errors(f"ppo@{args.round}"):
        cfg, params = stage_setup(args, PARAMS, "ppo")
        if args.round not in cfg.ppo.rounds:
            raise ConfigError(f"--round {args.round!r} is not a key of ppo.rounds ({', '.join(cfg.ppo.rounds)})")
        require_file(args.data, "scored rl data")
        require_file(args.init, "initial model")
        if args.val_data and cfg.ppo.val_every:
            require_file(args.val_data, "validation data")
        # heavy imports (torch, transformers, ray) only after the params are known to be valid; what they load
        # lives to the end of the process (rlcore.heap)
        with long_lived():
            from rlcore.engine.model import load_tokenizer
            from rlcore.trainer.loop.checkpoint import stage_checkpoints
            from rlcore.trainer.ppo import run_ppo_round
            tokenizer = load_tokenizer(args.init)
        # the round's checkpoints depend on its own entry of ppo.rounds, not on rounds added or changed after it
        own = {**params, "ppo": {**params["ppo"], "rounds": {args.round: params["ppo"]["rounds"][args.round]}}}
        inputs = [args.data, args.init] + ([args.val_data] if args.val_data and cfg.ppo.val_every else [])
        if args.teacher not in (None, cfg.distill.teacher):
            raise ConfigError(f"--teacher {args.teacher} is not distill.teacher {cfg.distill.teacher}")
        if cfg.algorithm.adv_estimator in TEACHER_ESTIMATORS:  # the teacher's weights shape every step
            require_file(cfg.distill.teacher, "distill.teacher")
            inputs.append(cfg.distill.teacher)
        checkpoints = stage_checkpoints(cfg, stage=f"ppo@{args.round}", save_every=cfg.ppo.save_every, params=own,
                                        root=REPO_ROOT, inputs=inputs)
        resume = checkpoints.resume()
        with stage_run(cfg, args, "ppo", params, round_name=args.round,
                       run_id=resume.run_id if resume else None) as tracker:
            metrics = run_ppo_round(cfg, round_name=args.round, init_dir=args.init, tokenizer=tokenizer,
                                    data_path=args.data, out_dir=args.out, tracker=tracker, plot_csv=args.plots,
                                    val_path=args.val_data, rollouts_path=args.rollouts, checkpoints=checkpoints,
                                    resume=resume)
            write_json(args.metrics, metrics)
            tracker.log_final(metrics, prefix=f"{args.round}/")
        checkpoints.finish()


if __name__ == "__main__":
    script(main)
