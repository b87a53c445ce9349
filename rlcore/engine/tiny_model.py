"""The built-in tiny model: a character-level tokenizer and a small random decoder.

Both are saved as ordinary Hugging Face folders (``tokenizer.json`` + config +
safetensors), so everything downstream loads them exactly like a local HF model.
The folder lives in a cache keyed by the shape and seed, so it is built once and
the same params always give the same weights.
"""

from __future__ import annotations

import hashlib
import json
import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]

# Jinja chat template: role markers are single tokens, the assistant turn ends with </s>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}{{ eos_token }}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (plus newline), and the special tokens."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    # BPE with no merges is exactly character-level; Fuse joins decoded characters.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.add_special_tokens(SPECIAL_TOKENS)
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(tokenizer, *, arch: str, hidden_size: int, num_layers: int, num_heads: int,
                     intermediate_size: int, max_position_embeddings: int, seed: int, num_kv_heads: int | None = None,
                     vocab_size: int | None = None, tie_word_embeddings: bool = False, rope_theta: float | None = None):
    """A randomly initialised decoder (Llama or Qwen2 config) sized for CPU training; ``vocab_size`` larger than the
    tokenizer's gives a real model's embedding and output sizes (the extra ids are never produced by the tokenizer),
    ``num_kv_heads`` grouped-query attention."""
    config = tiny_config(tokenizer, arch=arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                         num_kv_heads=num_kv_heads, vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings,
                         rope_theta=rope_theta)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def tiny_config(tokenizer, *, arch: str, hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
                max_position_embeddings: int, num_kv_heads: int | None = None, vocab_size: int | None = None,
                tie_word_embeddings: bool = False, rope_theta: float | None = None):
    """The Hugging Face config of :func:`build_tiny_model`."""
    extra = {} if rope_theta is None else {"rope_theta": rope_theta}
    return AutoConfig.for_model(
        arch,
        vocab_size=max(vocab_size or 0, len(tokenizer)),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
        **extra,
    )


def materialize_tiny(cache_root: Path, *, seed: int, **shape) -> Path:
    """Build (once) and return the folder of the tiny model for this shape and seed."""
    key = hashlib.sha256(json.dumps({"seed": seed, **shape}, sort_keys=True).encode()).hexdigest()[:12]
    folder = Path(cache_root) / f"tiny-{key}"
    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".tmp")
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=seed, **shape)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)  # atomic: a half-written folder is never picked up
    return folder
