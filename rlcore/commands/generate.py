"""``rlcore generate``: sample responses for a file of prompts on the Ray worker group."""

from __future__ import annotations

import argparse
from pathlib import Path

from rlcore.stage.frame import require_file
from rlcore.commands.common import add_config_options, config_from, positive_int
from rlcore.errors import ConfigError

HELP = "generate responses for a file of prompts (parquet rows or jsonl) into a parquet"
EXAMPLE = ("rlcore generate --model models/ppo/r1 --data data/processed/test.parquet --out gen.parquet "
           "--n 8 --temperature 1.0")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face model folder (a stage output)")
    p.add_argument("--data", required=True, metavar="FILE",
                   help="parquet in the pipeline's row schema, or jsonl of {\"prompt\": str} / {\"messages\": [...]}")
    p.add_argument("--out", required=True, metavar="FILE", help="parquet: the input columns plus the responses")
    p.add_argument("--n", type=positive_int, default=1, help="responses per prompt (default 1)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature, 0 = greedy (default: rollout.temperature)")
    p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=positive_int, default=None,
                   metavar="TOKENS", help="longest response in tokens, as serve's --max-tokens and the API's max_tokens "
                                          "(default: task.max_response_length; --max-new-tokens: its old spelling)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: seed from params)")
    add_config_options(p)


def run(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    if not (Path(args.model) / "adapter_config.json").is_file():  # a LoRA adapter folder loads over its base
        require_file(f"{args.model}/config.json", "model folder (config.json)")
    require_file(args.data, "prompts file")
    if args.temperature is not None and args.temperature < 0:
        raise ConfigError(f"--temperature {args.temperature}: expected >= 0 (0 = greedy)")
    from rlcore.trainer.generate import GenerateSettings, generate_records, write_generations

    settings = GenerateSettings(
        n=args.n, temperature=cfg.rollout.temperature if args.temperature is None else args.temperature,
        max_new_tokens=args.max_tokens or cfg.task.max_response_length,
        seed=cfg.seed if args.seed is None else args.seed)
    records = generate_records(cfg, model_dir=args.model, data_path=args.data, settings=settings)
    write_generations(records, args.out, {"model": args.model, "data": args.data, "engine": cfg.rollout.engine,
                                          "top_p": cfg.rollout.top_p, "top_k": cfg.rollout.top_k,
                                          **vars(settings)})
    print(f"wrote {len(records)} prompts x {settings.n} responses to {args.out}")
    return 0
