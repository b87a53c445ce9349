"""The ``model`` check: ``model.path`` is the built-in model or a complete local Hugging Face folder."""

from __future__ import annotations

import json
from pathlib import Path

from rlcore.diagnose.base import Check, Context, model_cache, register
from rlcore.engine.lora import adapter_base
from rlcore.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def _chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    cfg_file = folder / "tokenizer_config.json"
    try:
        return bool(cfg_file.is_file() and json.loads(cfg_file.read_text()).get("chat_template"))
    except (json.JSONDecodeError, OSError):
        return False


@register("model")
def check_model(ctx: Context) -> Check:
    path = ctx.cfg.model.path
    if path == "tiny":
        t = ctx.cfg.model.tiny
        return Check("model", "ok", f"tiny (built in: {t.arch}, hidden {t.hidden_size}, {t.num_layers} layers; "
                     f"cached under {model_cache()})")
    folder = Path(path) if Path(path).is_absolute() else ctx.root / path
    what = "a local Hugging Face model folder (config.json, weights, tokenizer with a chat template), or tiny"
    if not folder.is_dir():
        return Check("model", "fail", f"model.path {path!r}: no such folder ({folder})",
                     f"point model.path at {what}; nothing is downloaded at run time")
    if (folder / "adapter_config.json").is_file():
        return _check_adapter(path, folder)
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors)")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    elif not _chat_template(folder):
        missing.append("a chat template (chat_template.jinja or tokenizer_config.json chat_template)")
    if missing:
        return Check("model", "fail", f"model.path {path!r}: {folder} lacks {', '.join(missing)}",
                     f"point model.path at {what}; save_pretrained writes all of it")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, OSError) as err:
        return Check("model", "fail", f"model.path {path!r}: config.json does not parse ({err})",
                     "rewrite it (save_pretrained) or point model.path elsewhere")
    arch = ", ".join(config.get("architectures") or [config.get("model_type", "unknown type")])
    return Check("model", "ok", f"{folder}: {arch}, weights, tokenizer, chat template")




def _check_adapter(path: str, folder: Path) -> Check:
    """A LoRA adapter folder: its weights, and its base model folder (resolved relative to it)."""
    if not (folder / "adapter_model.safetensors").is_file():
        return Check("model", "fail", f"model.path {path!r}: {folder} has adapter_config.json but no "
                     "adapter_model.safetensors", "point model.path at a complete adapter folder")
    try:
        base = adapter_base(folder)
    except (UserError, ValueError, OSError) as err:
        return Check("model", "fail", str(err), "keep the adapter's base model folder where the adapter names it")
    return Check("model", "ok", f"{folder}: LoRA adapter over {base}")
