"""What a stage script does between parsing its arguments and its work, the same in every stage that trains, scores
or evaluates: :func:`stage_setup` (its params, validated, and the hashes of its recorded inputs) and
:func:`stage_run` (its MLflow run). ``rlcore.stage.frame`` has the rest of a stage's frame (arguments, errors,
outputs). Light, as that one: nothing here imports torch, pandas, ray or MLflow (the run opens MLflow when tracking is
on).
"""

from __future__ import annotations

import argparse
from typing import Any

from rlcore.stage.frame import REPO_ROOT, stage_config
from rlcore.config import Config
from rlcore.agents.check import check_agent_program
from rlcore.inputs import recorded_agent_inputs, recorded_reward_inputs, recorded_tool_inputs
from rlcore.pipeline_run import pipeline_params
from rlcore.tracking import open_run


def stage_setup(args: argparse.Namespace, sections: tuple[str, ...], stage: str) -> tuple[Config, dict[str, Any]]:
    """:func:`stage_config` of ``args.params``, and the params a stage logs: its sections, with the recorded
    hashes of the reward files and model (``reward_inputs``) and of an agent program's folder (``agent_inputs``, its
    file checked first) if its parser takes ``--rewards``, of the tool files (``tool_inputs``, when the agent loop has
    tools) if it takes ``--tools``."""
    cfg, params = stage_config(args.params, sections, stage)
    if hasattr(args, "rewards"):
        params = {**params, "reward_inputs": recorded_reward_inputs(cfg.reward, args.rewards)}
        if agent := recorded_agent_inputs(cfg.rollout.agent, args.rewards):  # the stages that run an agent program
            check_agent_program(cfg.rollout.agent)
            params = {**params, "agent_inputs": agent}
    if hasattr(args, "tools"):
        if tools := recorded_tool_inputs(cfg.rollout.agent, args.tools):
            params = {**params, "tool_inputs": tools}
    return cfg, params


def stage_run(cfg: Config, args: argparse.Namespace, stage: str, params: dict[str, Any], **kwargs: Any):
    """The stage's MLflow run (:func:`rlcore.tracking.open_run`: ``round_name``, ``run_id`` of a resumed one, ...),
    nested under the run of the pipeline whose params file is ``args.params``; a context manager."""
    return open_run(cfg.tracking, stage=stage, params=params, root=REPO_ROOT, pipeline=pipeline_params(args.params),
                    params_file=args.params, **kwargs)
