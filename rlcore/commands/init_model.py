"""``rlcore init-model``: a randomly initialised Hugging Face model folder that every stage accepts."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlcore.commands.common import positive_int
from rlcore.errors import ConfigError, InputNotFound

HELP = "write a randomly initialised Llama/Qwen2 model folder (safetensors, config, tokenizer)"
EXAMPLE = ("rlcore init-model --arch qwen2 --hidden-size 256 --num-layers 4 --num-heads 4 --out models/init-256 "
           "&& rlcore config check --set model.path=models/init-256; "
           "rlcore init-model --shape qwen2.5-0.5b --out models/qwen-0.5b-shaped")

# Published shapes (each model's config.json), random weights: a real size to measure memory and speed with.
SHAPES = {
    "qwen2.5-0.5b": {"arch": "qwen2", "hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
                     "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0},
    "qwen2.5-1.5b": {"arch": "qwen2", "hidden_size": 1536, "num_layers": 28, "num_heads": 12, "num_kv_heads": 2,
                     "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a published model's dimensions (random weights; the flags below override them)")
    p.add_argument("--arch", choices=("llama", "qwen2"), default=None, help="Hugging Face architecture")
    p.add_argument("--hidden-size", type=positive_int, default=None, metavar="H")
    p.add_argument("--num-layers", type=positive_int, default=None, metavar="L")
    p.add_argument("--num-heads", type=positive_int, default=None, metavar="A", help="attention heads (divide H)")
    p.add_argument("--num-kv-heads", type=positive_int, default=None, metavar="K",
                   help="key-value heads, grouped-query attention (divide A; default A)")
    p.add_argument("--intermediate-size", type=positive_int, default=None, metavar="I", help="MLP width (default 4H)")
    p.add_argument("--vocab-size", type=positive_int, default=None, metavar="V",
                   help="embedding and output rows (default: the tokenizer's; more gives a real model's sizes)")
    p.add_argument("--tie-word-embeddings", action="store_true", default=None,
                   help="the output layer shares the input embedding's weights")
    p.add_argument("--max-position-embeddings", type=positive_int, default=None, metavar="P",
                   help="longest sequence (default 2048)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to create (must not exist or be empty)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a local tokenizer folder with a chat template (default: the built-in character tokenizer)")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")


def _resolved(args: argparse.Namespace) -> dict:
    """The shape: the preset's, then each flag given over it, then the defaults."""
    shape = {"max_position_embeddings": 2048, "tie_word_embeddings": False, **SHAPES.get(args.shape or "", {})}
    for key in ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
                "tie_word_embeddings", "max_position_embeddings"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    missing = [f"--{k.replace('_', '-')}" for k in ("arch", "hidden_size", "num_layers", "num_heads") if k not in shape]
    if missing:
        raise ConfigError(f"give {', '.join(missing)} (or --shape {' | '.join(sorted(SHAPES))})")
    shape.setdefault("intermediate_size", 4 * shape["hidden_size"])
    return shape


def run(args: argparse.Namespace) -> int:
    shape = _resolved(args)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty folder; choose a new path")
    hidden, heads = shape["hidden_size"], shape["num_heads"]
    if hidden % heads:
        raise ConfigError(f"--hidden-size {hidden} is not divisible by --num-heads {heads}")
    if (hidden // heads) % 2:
        raise ConfigError(f"--hidden-size / --num-heads = {hidden // heads}: rotary embeddings need an even head "
                          "dimension")
    if heads % shape.get("num_kv_heads", heads):
        raise ConfigError(f"--num-heads {heads} is not divisible by --num-kv-heads {shape['num_kv_heads']}")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        raise InputNotFound(f"--tokenizer {args.tokenizer}: not a folder (a local tokenizer, never a hub name)")
    from rlcore.engine.model import load_tokenizer
    from rlcore.engine.tiny_model import build_char_tokenizer, build_tiny_model

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=args.seed, **shape)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)  # a half-written folder never appears under --out
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {shape['arch']}, {n_params / 1e6:.2f}M parameters, vocab {model.config.vocab_size} "
          f"(tokenizer {len(tokenizer)}), context {shape['max_position_embeddings']}; use it with --set model.path={out}")
    return 0
