"""``rlcore eval``: score a generations file with the params' reward (the rule of each row's data_source, reward.functions, reward.model)."""

from __future__ import annotations

import argparse
import json

from rlcore.stage.frame import write_json
from rlcore.commands.common import add_config_options, config_from, positive_int

HELP = "score a generations file with the params' reward: mean reward, pass@1 and pass@k per data_source"
EXAMPLE = "rlcore eval --generations gen.parquet --k 8 --out eval.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--generations", required=True, metavar="FILE",
                   help="parquet (or jsonl) with a 'responses' list per row, e.g. from rlcore generate")
    p.add_argument("--k", type=positive_int, default=None, help="pass@k's k (default: evaluate.k from params)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the results as JSON")
    add_config_options(p)


def format_table(result: dict) -> str:
    """One line per data_source and one for all rows, aligned."""
    k = result["k"]
    head = ("data_source", "prompts", "responses", "mean_reward", "pass@1", f"pass@{k}")
    lines = [(ds, s) for ds, s in result["by_data_source"].items()] + [("all", result)]
    cells = [head] + [(ds, str(s["n_prompts"]), str(s["n_responses"]), f"{s['mean_reward']:.4f}",
                       f"{s['pass@1']:.4f}", f"{s['pass@k']:.4f}") for ds, s in lines]
    widths = [max(len(row[c]) for row in cells) for c in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) if c == 0 else v.rjust(w) for c, (v, w) in enumerate(zip(row, widths)))
                     for row in cells)


def run(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    k = args.k if args.k is not None else cfg.evaluate.k
    from rlcore.rewards.generations import evaluate_generations
    from rlcore.rewards.scoring import RewardScorer

    scorer = RewardScorer.from_config(cfg.reward)
    model = None
    if cfg.reward.model is not None:  # torch and the model only when the params name one
        from rlcore.engine.reward_model import LocalRewardModel

        rm = cfg.reward.model
        model = LocalRewardModel(rm.path, weight=rm.weight, normalize=rm.normalize)
    result = evaluate_generations(args.generations, k, scorer, model)
    print(format_table(result))
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    else:
        print(json.dumps({key: result[key] for key in ("pass@1", "pass@k", "mean_reward", "n_prompts")}))
    return 0
