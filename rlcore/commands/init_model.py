"""``rlcore init-model``: a randomly initialised Hugging Face model folder that every stage accepts."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlcore.commands.common import positive_int

HELP = "write a randomly initialised Llama/Qwen2 model folder (safetensors, config, tokenizer)"
EXAMPLE = ("rlcore init-model --arch qwen2 --hidden-size 256 --num-layers 4 --num-heads 4 --out models/init-256 "
           "&& rlcore config check --set model.path=models/init-256")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=("llama", "qwen2"), required=True, help="Hugging Face architecture")
    p.add_argument("--hidden-size", type=positive_int, required=True, metavar="H")
    p.add_argument("--num-layers", type=positive_int, required=True, metavar="L")
    p.add_argument("--num-heads", type=positive_int, required=True, metavar="A", help="attention heads (divide H)")
    p.add_argument("--intermediate-size", type=positive_int, default=None, metavar="I", help="MLP width (default 4H)")
    p.add_argument("--max-position-embeddings", type=positive_int, default=2048, metavar="P",
                   help="longest sequence (default 2048)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to create (must not exist or be empty)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a local tokenizer folder with a chat template (default: the built-in character tokenizer)")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed (default 0)")


def run(args: argparse.Namespace) -> int:
    from rlcore.errors import ConfigError

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: exists and is not an empty folder; choose a new path")
    if args.hidden_size % args.num_heads:
        raise ConfigError(f"--hidden-size {args.hidden_size} is not divisible by --num-heads {args.num_heads}")
    if (args.hidden_size // args.num_heads) % 2:
        raise ConfigError(f"--hidden-size / --num-heads = {args.hidden_size // args.num_heads}: rotary embeddings "
                          "need an even head dimension")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        from rlcore.errors import InputNotFound

        raise InputNotFound(f"--tokenizer {args.tokenizer}: not a folder (a local tokenizer, never a hub name)")
    from rlcore.engine.model import load_tokenizer
    from rlcore.engine.tiny_model import build_char_tokenizer, build_tiny_model

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else build_char_tokenizer()
    model = build_tiny_model(tokenizer, arch=args.arch, hidden_size=args.hidden_size, num_layers=args.num_layers,
                             num_heads=args.num_heads, intermediate_size=args.intermediate_size or 4 * args.hidden_size,
                             max_position_embeddings=args.max_position_embeddings, seed=args.seed)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)  # a half-written folder never appears under --out
    n_params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {args.arch}, {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}, "
          f"context {args.max_position_embeddings}; use it with --set model.path={out}")
    return 0
