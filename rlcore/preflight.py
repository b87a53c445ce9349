"""What ``rlcore config check`` verifies beyond the params' schema, before any stage runs: the task's files and
the reward.

* each ``task.file`` exists and its first row turns into a pipeline row with ``task.columns``;
* each reward function's file imports, has the function, takes verl's arguments and, called once on a sample
  row of the task (its ground truth as the answer), returns a number, None or a dict with ``score``;
* ``reward.model`` is a Hugging Face folder, or the output of an ``rm`` stage of this params file;
* with the tool loop, each of ``rollout.agent.tools`` imports in a tool process and is a function with a schema
  (or the one environment class);
* ``model.path`` is the built-in model or a complete model folder (``rlcore diagnose``'s model check), and each
  model or data path a stage starts from (``ppo.rounds.*.init``, ``rm.models.*``) is one that is there or one an
  earlier stage of these params writes.

Each problem is a one-line :class:`~rlcore.errors.UserError` naming the file, row, function or key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.agents.check import check_agent_program, tool_schemas
from rlcore.config import Config
from rlcore.diagnose.base import Context
from rlcore.diagnose.model import check_model
from rlcore.errors import ConfigError
from rlcore.registry import options_from


def sample_row(cfg: Config) -> tuple[dict[str, Any], str]:
    """A row of the task in the pipeline's schema, and where it comes from (for messages)."""
    t = cfg.task
    if t.name == "file":
        from rlcore.data.files import file_rows

        split, path = ("sft", t.file["sft"]) if "sft" in t.file else ("train", t.file["train"])
        for key, other in t.file.items():  # every file's first row converts
            file_rows(other, columns=t.columns, data_source=t.data_source, split=key, limit=1,
                      need_demonstration=key == "sft" or (key == "train" and "sft" not in t.file))
        return file_rows(path, columns=t.columns, data_source=t.data_source, split=split, limit=1)[0], \
            f"{path}: row 0"
    if t.name == "gsm8k":
        from rlcore.data.gsm8k import gsm8k_rows

        gsm8k_rows(t.file["test"], split="test")[:1]
        return gsm8k_rows(t.file["train"], split="train")[0], f"{t.file['train']}: row 0"
    from rlcore.data.splits import build_splits, task_options

    options = options_from(t, task_options(t.name) - {"seed"})
    options.update(n_sft=1, n_rl=1, n_test=1)
    return build_splits(t.name, seed=cfg.seed, **options)["test"][0], f"task {t.name}: a test row"


def check_reward(cfg: Config, row: dict[str, Any], where: str) -> int:
    """Probe every reward function on ``row`` (:func:`rlcore.rewards.scoring.probe`); the number probed."""
    from rlcore.rewards.scoring import RewardScorer, probe, samples_of

    model = cfg.reward.model
    if model is not None and not (Path(model.path) / "config.json").is_file():
        produced = {f"models/rm/{name}" for name in cfg.rm.models}
        if str(Path(model.path)) not in produced:
            raise ConfigError(f"reward.model.path {model.path!r}: not a Hugging Face folder (no config.json) and no "
                              f"rm stage of this params file writes it ({', '.join(sorted(produced)) or 'rm.models is empty'})")
    if not cfg.reward.functions:
        return 0
    truth = row["reward_model"]["ground_truth"]
    scorer = RewardScorer.from_config(cfg.reward)
    try:
        probe(scorer, samples_of([row["data_source"]], [truth], [truth], [row["extra_info"]])[0],
              where=f"{where} (its ground truth as the answer)")
    finally:
        scorer.pool.close()
    return len(cfg.reward.functions)


# what the prepare stage writes into data/processed (rlcore.trainer.prepare): the splits, and the preference pairs
SPLIT_FILES = ("sft_train", "rl_train", "test")


def check_model_path(cfg: Config, root: Path) -> str:
    """``model.path``: a ConfigError with what is wrong and what to do, or what was found."""
    found = check_model(Context(cfg=cfg, root=root))
    if found.status == "fail":
        raise ConfigError(f"{found.detail}; {found.fix}")
    return f"model.path: {found.detail}"


def _produced(cfg: Config) -> tuple[set[str], set[str]]:
    """The model folders and data files the stages of ``cfg`` write (relative to the repository)."""
    models = {"models/sft", *(f"models/ppo/{r}" for r in cfg.ppo.rounds), *(f"models/rm/{m}" for m in cfg.rm.models)}
    data = {f"data/processed/{name}.parquet" for name in SPLIT_FILES}
    data |= {f"data/processed/pairs_{split}.parquet" for split in ("train", "test")
             if getattr(cfg.task.pairs, f"n_{split}") > 0}
    return models, data


def check_stage_paths(cfg: Config, root: Path) -> list[str]:
    """Each round's ``init``, the distillation teacher (a dependency of every round, whichever estimator reads it) and
    each reward model's ``init``, ``train`` and ``test``: written by a stage of these params before it (an earlier
    round), or there already (a model folder, a file). A line for each."""
    models, data = _produced(cfg)
    rounds = list(cfg.ppo.rounds)
    wanted = [(f"ppo.rounds.{r}.init", cfg.ppo.rounds[r].init, "model",
               {"models/sft", *(f"models/ppo/{e}" for e in rounds[:i])}) for i, r in enumerate(rounds)]
    wanted.append(("distill.teacher", cfg.distill.teacher, "model", {"models/sft"}))
    for name, m in cfg.rm.models.items():
        wanted += [(f"rm.models.{name}.init", m.init, "model", models - {f"models/rm/{name}"}),
                   (f"rm.models.{name}.train", m.train, "file", data), (f"rm.models.{name}.test", m.test, "file", data)]
    lines = []
    for key, value, kind, written in wanted:
        path = str(Path(value))
        here = root / path
        there = (here / "config.json").is_file() or (here / "adapter_config.json").is_file() if kind == "model" \
            else here.is_file()
        if path not in written and not there:
            what = "a model folder (config.json)" if kind == "model" else "a file"
            raise ConfigError(f"{key} {value!r}: not {what} here, and no earlier stage of these params writes it "
                              f"({', '.join(sorted(written)) or 'none'})")
        lines.append(f"{key}: {value}: {'an earlier stage writes it' if path in written else 'there'}")
    return lines


def check_inputs(cfg: Config, root: Path | None = None) -> list[str]:
    """Run every check above; one line per thing checked, for ``rlcore config check`` to print."""
    root = Path.cwd() if root is None else root
    lines = [check_model_path(cfg, root), *check_stage_paths(cfg, root)]
    row, where = sample_row(cfg)
    for key, path in cfg.task.file.items() if cfg.task.name in ("file", "gsm8k") else ():
        lines.append(f"task.file.{key}: {path}: readable, first row ok")
    probed = check_reward(cfg, row, where)
    for f in cfg.reward.functions:
        lines.append(f"reward function {f.name} ({f.path}:{f.name}): imports, called once on {where}: ok")
    if cfg.reward.model is not None:
        lines.append(f"reward.model: {cfg.reward.model.path}: ok")
    assert probed == len(cfg.reward.functions)
    if cfg.rollout.agent.loop == "tool":
        functions = {s["function"]["name"] for s in tool_schemas(cfg.rollout.agent) or []}
        for t in cfg.rollout.agent.tools:
            kind = "a function, schema from its hints and docstring" if t.name in functions else "an environment"
            lines.append(f"tool {t.name} ({t.path}): imports in a tool process, {kind}: ok")
    if cfg.rollout.agent.loop == "openai":
        check_agent_program(cfg.rollout.agent)
        (agent,) = cfg.rollout.agent.agents
        lines.append(f"agent {agent.name} ({agent.path}): imports, async def {agent.name}(client, row): ok")
    return lines
