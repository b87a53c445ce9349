"""``rlcore export``: a plain Hugging Face folder from a saved stage model (or a step checkpoint)."""

from __future__ import annotations

import argparse
import sys

from rlcore.errors import ConfigError

HELP = "export a saved model or step checkpoint to a Hugging Face folder, checked to give the same logits"
EXAMPLE = "rlcore export --model models/ppo/r1 --out exported/r1 --dtype bfloat16"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a stage's model folder (models/ppo/r1) or a step checkpoint (checkpoints/ppo@r1/step_00000050)")
    p.add_argument("checkpoint", nargs="?", default=None, metavar="CHECKPOINT",
                   help="the same as --model, its old spelling (kept for scripts that pass it first)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to create (must not exist or be empty)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="weight dtype of the export (default float32, as trained)")
    p.add_argument("--no-verify", action="store_true", help="skip the logits comparison after writing")


def run(args: argparse.Namespace) -> int:
    from rlcore.export import export_model

    if (args.model is None) == (args.checkpoint is None):
        raise ConfigError("give the model to export once: --model DIR (a stage's model folder or a step checkpoint)")
    if args.checkpoint is not None:
        print(f"rlcore export: the positional CHECKPOINT is the old spelling of --model {args.checkpoint}",
              file=sys.stderr)
    report = export_model(args.model or args.checkpoint, args.out, dtype=args.dtype, verify=not args.no_verify)
    print(report)
    return 0
