"""``rlcore export``: a plain Hugging Face folder from a saved stage model (or a step checkpoint)."""

from __future__ import annotations

import argparse

HELP = "export a saved model or step checkpoint to a Hugging Face folder, checked to give the same logits"
EXAMPLE = "rlcore export models/ppo/r1 --out exported/r1 --dtype bfloat16"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a stage's model folder (models/ppo/r1) or a step checkpoint (checkpoints/ppo@r1/step_00000050)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to create (must not exist or be empty)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="weight dtype of the export (default float32, as trained)")
    p.add_argument("--no-verify", action="store_true", help="skip the logits comparison after writing")


def run(args: argparse.Namespace) -> int:
    from rlcore.export import export_model

    report = export_model(args.checkpoint, args.out, dtype=args.dtype, verify=not args.no_verify)
    print(report)
    return 0
