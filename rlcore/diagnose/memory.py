"""The ``memory`` check: will the configured model, dtype, optimizer and copies fit in this machine's memory (or each
rank's GPU)? The estimate of ``rlcore.engine.footprint`` for the SFT stage and a PPO round, as the stages print it."""

from __future__ import annotations

from pathlib import Path

from rlcore.diagnose.base import Check, Context, register
from rlcore.engine import footprint
from rlcore.engine.lora import architecture_folder


def _model(ctx: Context):
    """The model folder (or, for the built-in model, its config: nothing is written)."""
    if ctx.cfg.model.path != "tiny":
        path = Path(ctx.cfg.model.path)
        return path if path.is_absolute() else ctx.root / path
    from rlcore.engine.tiny_model import build_char_tokenizer, tiny_config

    t = ctx.cfg.model.tiny
    return tiny_config(build_char_tokenizer(), arch=t.arch, hidden_size=t.hidden_size, num_layers=t.num_layers,
                       num_heads=t.num_heads, intermediate_size=t.intermediate_size,
                       max_position_embeddings=t.max_position_embeddings)


@register("memory")
def check_memory(ctx: Context) -> Check:
    model = _model(ctx)
    if isinstance(model, Path) and not (architecture_folder(model) / "config.json").is_file():
        return Check("memory", "warn", f"model.path {ctx.cfg.model.path!r}: no model folder to estimate from",
                     "fix the model check above first")
    problems = [line for stage in ("sft", "ppo") if (line := footprint.warning(ctx.cfg, model, stage))]
    if problems:
        return Check("memory", "warn", " | ".join(problems),
                     "LoRA (actor/critic/sft.lora.rank), gradient checkpointing or smaller micro-batches; see "
                     "docs/how-to/lora.md")
    sizes = "; ".join(e.describe() for stage in ("sft", "ppo") for e in footprint.estimates(ctx.cfg, model, stage))
    return Check("memory", "ok", f"fits: {sizes}")
