"""One PPO-family round from the stage's point of view: start the worker groups, compose the round runner for
``ppo.mode`` (:mod:`rlcore.trainer.round.modes`), and run the loop of steps (validation, the rollouts file, step
checkpoints and resume, divergence), then save the model.

A runner (:class:`~rlcore.trainer.round.runner.RoundRunner`) is a batch source and a PPO step: ``sync``'s source is
the trainer's own ranks, ``async``'s the generators' queue. Either steps the same way (``runner.step(i)`` returns
the step's metrics), so the loop below serves both.
"""

from __future__ import annotations

import time

import numpy as np

from rlcore.agents.check import tool_schemas
from rlcore.config import Config
from rlcore.data.collate import prompt_batch
from rlcore.protocol import Batch, Metrics
from rlcore.rewards.checks import read_reward_rows
from rlcore.trainer.loop.checkpoint import Resume, StepCheckpoints
from rlcore.trainer.loop.job import training_job
from rlcore.trainer.loop.model_specs import check_model
from rlcore.trainer.loop.step_log import StepLog
from rlcore.trainer.loop.steps import Divergence, Done, StepLoop
from rlcore.trainer.round.kept_samples import log_rollouts_page
from rlcore.trainer.round.modes import round_on_pool
from rlcore.trainer.round.seeds import round_seed
from rlcore.trainer.round.teacher import check_teacher
from rlcore.trainer.round.validation import Validation
from rlcore.trainer.samples.scoring import reward_scorer
from rlcore.viewer import RolloutsFile


def run_ppo_round(cfg: Config, *, round_name: str, init_dir: str, tokenizer, data_path: str, out_dir: str,
                  tracker, plot_csv: str | None = None, val_path: str | None = None,
                  rollouts_path: str | None = None, checkpoints: StepCheckpoints | None = None,
                  resume: Resume | None = None) -> Metrics:
    """Train one round from ``init_dir``; save the policy (and critic) to ``out_dir``.

    With ``ppo.val_every`` > 0 and ``val_path``, the greedy pass@1 on those prompts is logged
    before the first step, every ``val_every`` steps and after the last (:mod:`rlcore.trainer.round.validation`).
    With ``ppo.log_samples`` > 0, that many samples per step go to ``rollouts_path`` (a parquet rewritten atomically
    after every step, so a crash keeps the steps so far; see :mod:`rlcore.viewer`), and at the end to MLflow: the
    table ``rollout_samples.json`` and the page ``rollouts.html``.

    With ``checkpoints``, a step checkpoint is written every ``ppo.save_every`` steps; with ``resume``, the
    round continues after the checkpoint's step from its state (``rlcore.trainer.loop.checkpoint``) and ends as
    the uninterrupted round would.

    Workers skip an optimizer step whose loss or gradient norm is not finite (``actor/nonfinite_steps``,
    ``critic/nonfinite_steps``); after ``actor``/``critic.max_nonfinite_steps`` in a row the round raises
    :class:`~rlcore.errors.TrainingDiverged` once that step is logged
    (:func:`~rlcore.trainer.loop.step_log.stop_if_diverged`)."""
    steps = cfg.ppo.rounds[round_name].steps
    prompts, tools = round_prompts(cfg, data_path, tokenizer)
    check_model(cfg, init_dir, "ppo")
    check_teacher(cfg, init_dir)
    validation = Validation.read(cfg, val_path, tokenizer, tools, steps)
    log = StepLog(tracker, plot_csv)
    loop = round_loop(cfg, round_name, steps, log, tracker=tracker, checkpoints=checkpoints, resume=resume)
    rollouts = RolloutsFile(rollouts_path) if rollouts_path else None
    start = time.perf_counter()
    with training_job(cfg, resume) as job:
        runner = job.start(round_on_pool(cfg, job.pool, init_dir=init_dir, tokenizer=tokenizer, prompts=prompts,
                                         seed=round_seed(cfg.seed, round_name), steps=steps))
        first = validation.begin(runner, tracker, resume)  # the starting model's, in step 0's row too
        if resume is not None and rollouts is not None:
            rollouts.update(runner.samples)
        loop.run(lambda n: Done({**(first if n == loop.start else {}), **runner.step(n),
                                 **validation.after(n, runner)}),
                 save=lambda folder: Done(runner.save_state(folder)),
                 state=lambda: {**validation.state(), "model_dir": str(init_dir)},
                 on_row=None if rollouts is None else lambda: rollouts.update(runner.samples))
        job.save(lambda: runner.save(out_dir), f"the round's model to {out_dir}")
    tracker.log_table(runner.samples, "rollout_samples.json")
    log_rollouts_page(tracker, runner.samples, title=f"ppo {round_name}: rollouts")
    return round_summary(log.rows, validation.rows, steps, time.perf_counter() - start)


def round_prompts(cfg: Config, data_path: str, tokenizer) -> tuple[Batch, list[dict] | None]:
    """The round's prompts and the tool loop's function schemas they show, with each reward function called once on
    the first row and each tool file described in a tool process: a bad reward or tool file stops the round before
    Ray starts."""
    rows = read_reward_rows(data_path, cfg.reward)
    reward_scorer(cfg.reward, rows, data_path)
    tools = tool_schemas(cfg.rollout.agent)
    return prompt_batch(rows, tokenizer, cfg.task.max_prompt_length, data_path, tools), tools


def round_loop(cfg: Config, round_name: str, steps: int, log: StepLog, **kwargs) -> StepLoop:
    """The round's step loop (``kwargs``: its tracker, checkpoints and resume), stopped when the actor's or the
    critic's optimizer skips ``max_nonfinite_steps`` steps in a row."""
    divergence = [Divergence(role, getattr(cfg, role).max_nonfinite_steps, (f"{role}/{loss}", f"{role}/grad_norm"),
                             f"lower {role}.lr or check the rewards")
                  for role, loss in (("actor", "pg_loss"), ("critic", "vf_loss"))]
    return StepLoop(f"ppo {round_name}", steps, log, **kwargs, divergence=divergence,
                    postfix=lambda m: {"acc": f"{m['rollout/acc']:.3f}", "len": f"{m['rollout/response_length']:.1f}"})


def round_summary(rows: list[Metrics], val_rows: list[Metrics], steps: int, wall_s: float) -> Metrics:
    """The round's metrics file: first/last validation, accuracy of the first and last 10 steps, the reward
    functions' errors and timeouts of all steps; with the tool loop, each ``agent/*`` metric's mean over the last
    10 steps (``ppo/agent/<name>_last10``) and the last validation's (``ppo/val/agent/<name>``), as eval.json has
    the evaluation's."""
    tail = rows[-min(10, len(rows)):]
    out: Metrics = {}
    if val_rows:
        out = {"ppo/val_greedy_pass@1_first": val_rows[0]["val/greedy_pass@1"],
               "ppo/val_greedy_pass@1_last": val_rows[-1]["val/greedy_pass@1"],
               **{f"ppo/{k}": v for k, v in val_rows[-1].items() if k.startswith("val/agent/")}}
    agent = sorted({k for r in tail for k in r if k.startswith("agent/")})
    out.update({f"ppo/{k}_last10": float(np.mean([r[k] for r in tail if k in r])) for k in agent})
    return {
        **out,
        "ppo/acc_first_step": rows[0]["rollout/acc"],
        "ppo/acc_last10": float(np.mean([r["rollout/acc"] for r in tail])),
        "ppo/reward_last10": float(np.mean([r["rollout/reward_mean"] for r in tail])),
        "ppo/reward_errors": int(sum(r["reward/errors"] for r in rows)),
        "ppo/reward_timeouts": int(sum(r["reward/timeouts"] for r in rows)),
        "ppo/steps": steps,
        "ppo/wall_s": wall_s,
    }
