"""What a job's worker groups load: the model spec of params.yaml's ``model`` and ``resources`` (and a training
role's LoRA and memory settings), and the checks of those settings a stage runs before Ray starts."""

from __future__ import annotations

import sys
from pathlib import Path

from rlcore.config import Config
from rlcore.engine import footprint, lora
from rlcore.engine.lora import LoraSpec
from rlcore.engine.model import ModelSpec
from rlcore.errors import ConfigError


def model_spec(cfg: Config, path: str | Path, role: str | None = None) -> ModelSpec:
    """How workers load and wrap the model at ``path`` (params.yaml ``model`` and ``resources``); for a model that
    trains, or a rollout copy of one, its ``role`` (``sft``, ``actor``, ``critic``) adds that section's LoRA, gradient
    checkpointing and the offload settings."""
    m, r = cfg.model, cfg.resources
    trained = {}
    if role is not None:
        section = getattr(cfg, role)
        lora = section.lora
        trained = {"lora": LoraSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                    target_modules=lora.target_modules, seed=cfg.seed),
                   "gradient_checkpointing": section.gradient_checkpointing, "offload_params": r.offload.params}
    return ModelSpec(path=str(path), dtype=m.dtype, attn_implementation=m.attn_implementation,
                     packed_forward=m.packed_forward, strategy=r.strategy,
                     reshard_after_forward=r.reshard_after_forward, ref_reshard_after_forward=r.ref_reshard_after_forward,
                     **trained)


def check_model(cfg: Config, model_dir: str | Path, stage: str) -> None:
    """Before Ray starts: LoRA settings that cannot work are a ConfigError naming the key (target modules the model
    lacks; an adapter to train on whose rank or alpha differ), and an estimate of the stage's memory that does not fit
    is printed as a warning (``rlcore.engine.footprint``). ``stage``: ``sft`` or ``ppo``."""
    # (a critic never continues an adapter: it starts a fresh one on its merged folder)
    roles: dict[str, dict[str, Path | None]] = {"sft": {"sft": Path(model_dir)},
                                                "ppo": {"actor": Path(model_dir), "critic": None}}
    shape = footprint.model_shape(model_dir)
    for role, folder in roles[stage].items():
        settings = getattr(cfg, role).lora
        if not settings.rank:
            continue
        spec = LoraSpec(rank=settings.rank, alpha=settings.alpha, dropout=settings.dropout,
                        target_modules=settings.target_modules)
        if folder is not None and lora.is_adapter(folder):
            lora.check_continues(spec, folder, f"{role}.lora")
        elif not isinstance(settings.target_modules, str):
            unknown = sorted(set(settings.target_modules) - shape.linear_names)
            if unknown:
                raise ConfigError(f"{role}.lora.target_modules: {', '.join(unknown)}: no linear layer of that name in "
                                  f"{model_dir} (it has {', '.join(sorted(shape.linear_names))})")
    line = footprint.warning(cfg, model_dir, stage)
    if line:
        print(f"warning: {line}", file=sys.stderr, flush=True)
