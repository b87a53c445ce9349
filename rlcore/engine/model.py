"""Loading models and tokenizers from local Hugging Face folders (never from a hub)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from rlcore.engine.tiny_model import materialize_tiny

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Cache for the built-in model, outside the DVC-tracked folders.
TINY_CACHE = Path(os.environ.get("RLCORE_CACHE", Path.home() / ".cache" / "rlcore"))


def resolve_model_path(path: str, *, tiny_shape: dict, seed: int) -> Path:
    """'tiny' -> the built-in model folder; otherwise a local HF folder that must exist."""
    if path == "tiny":
        return materialize_tiny(TINY_CACHE, seed=seed, **tiny_shape)
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model.path {path!r}: expected a local Hugging Face model folder with config.json")
    return folder


def load_tokenizer(path: str | Path):
    """Tokenizer from a local folder; a missing pad token falls back to EOS."""
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ValueError(f"{path}: tokenizer has no chat_template; prompts are chat messages")
    return tok


def load_causal_lm(path: str | Path, *, dtype: str = "float32", attn_implementation: str = "sdpa"):
    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPES[dtype], attn_implementation=attn_implementation, local_files_only=True
    )


def load_value_model(path: str | Path, *, dtype: str = "float32", attn_implementation: str = "sdpa"):
    """A token-classification head with one output on the policy backbone (the critic).

    Loading a causal-LM folder initialises the value head fresh; loading a saved critic
    folder restores it.
    """
    return AutoModelForTokenClassification.from_pretrained(
        str(path), num_labels=1, dtype=DTYPES[dtype], attn_implementation=attn_implementation,
        local_files_only=True,
    )
