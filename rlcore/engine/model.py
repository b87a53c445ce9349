"""Loading models and tokenizers from local Hugging Face folders (never from a hub)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from rlcore.engine import packed
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


def attention_for(path: str | Path, attn_implementation: str, packed_forward: bool) -> str:
    """The attention implementation to load with: the packed one (``rlcore.engine.packed``) when
    asked for, on top of sdpa, and the architecture allows it; otherwise the one configured."""
    if not packed_forward or attn_implementation != "sdpa":
        return attn_implementation
    reason = packed.packing_supported(AutoConfig.from_pretrained(str(path), local_files_only=True))
    if reason:
        print(f"model.packed_forward: {path}: {reason}; running padded forwards", file=sys.stderr, flush=True)
        return attn_implementation
    return packed.ATTN_NAME


def load_causal_lm(path: str | Path, *, dtype: str = "float32", attn_implementation: str = "sdpa",
                   packed_forward: bool = False):
    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPES[dtype], attn_implementation=attention_for(path, attn_implementation, packed_forward),
        local_files_only=True,
    )


def load_value_model(path: str | Path, *, dtype: str = "float32", attn_implementation: str = "sdpa",
                     packed_forward: bool = False):
    """A token-classification head with one output on the policy backbone (the critic).

    Loading a causal-LM folder initialises the value head fresh; loading a saved critic
    folder restores it.
    """
    return AutoModelForTokenClassification.from_pretrained(
        str(path), num_labels=1, dtype=DTYPES[dtype],
        attn_implementation=attention_for(path, attn_implementation, packed_forward), local_files_only=True,
    )
