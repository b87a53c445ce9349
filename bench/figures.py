"""The headline figures of README.md and the results pages, rendered from the stored results data, so that every
page shows the same value of a figure and says where it comes from.

    .venv/bin/python -m bench.figures            # write every marked block again
    .venv/bin/python -m bench.figures --check    # exit 1 naming the blocks that differ from the data

A block is the text between ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->`` in README.md or a page under
docs/; :data:`BLOCKS` renders each NAME from:

* ``metrics/eval.json`` and ``plots/ppo_r1.csv``: what ``make run`` writes (seed 42), with
  ``docs/results/data/make_run.json`` saying when, where and at which commit it last ran;
* ``docs/results/data/recipes.json``: every recipe over seeds 1-3 (``bench.recipe_seeds --out``; each row says when,
  where, with which kernels and at which commit it was measured; ``bench.recipe_table`` renders the recipes page's
  table from it);
* ``docs/results/data/default_recipe_seeds.json``: the default recipe over 11 seeds, an earlier measurement;
* the ``async`` section of ``bench/RESULTS.md`` (``make bench-async``).

tests/test_docs.py fails while a block differs from what its data renders.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from bench.sections import sections
from rlcore.compare.report import format_p, format_stat
from rlcore.compare.stats import paired_difference, t_interval

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "docs" / "results" / "data"
BLOCK = re.compile(r"(<!-- figures:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.DOTALL)


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _recipes() -> dict[str, list[dict]]:
    return _json(DATA / "recipes.json")


def _where(rows: list[dict]) -> str:
    """When, where, with which kernels and at which code the rows were measured (each distinct value once)."""
    measured = list(dict.fromkeys(r["measured"] for r in rows))
    commits = list(dict.fromkeys(r["commit"] for r in rows))
    if len(commits) > 1:  # say which seed ran which code
        commits = [f"seed {', '.join(str(r['seed']) for r in rows if r['commit'] == c)}: {c}" for c in commits]
    return f"{'; '.join(measured)}; code: {'; '.join(commits)}"


def _spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def make_run_table() -> str:
    ev, run = _json(REPO / "metrics" / "eval.json"), _json(DATA / "make_run.json")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    final = params["evaluate"]["final_round"]
    estimator = params["algorithm"]["adv_estimator"].upper() if params["algorithm"]["adv_estimator"] == "grpo" \
        else params["algorithm"]["adv_estimator"]
    k = params["evaluate"]["k"]
    return "\n".join([
        f"| model | greedy pass@1 | sampled pass@1 | pass@{k} |", "| --- | --- | --- | --- |",
        f"| SFT ({params['sft']['steps']} steps) | {ev['sft/greedy_pass@1']:.3f} | {ev['sft/pass@1']:.3f} | "
        f"{ev[f'sft/pass@{k}']:.3f} |",
        f"| after `ppo@{final}` ({estimator}, {params['ppo']['rounds'][final]['steps']} steps) | "
        f"**{ev['final/greedy_pass@1']:.3f}** ({ev['gain/greedy_pass@1']:+.3f}) | {ev['final/pass@1']:.3f} | "
        f"{ev[f'final/pass@{k}']:.3f} |", "",
        f"`{run['command']}` (seed {run['seed']}), `metrics/eval.json` on {ev['test/n_prompts']:.0f} held-out "
        f"problems: {run['measured']}; code: {run['commit']}."])


def make_run_validation() -> str:
    with (REPO / "plots" / "ppo_r1.csv").open() as f:
        points = [(int(r["step"]), float(r["val/greedy_pass@1"])) for r in csv.DictReader(f) if r["val/greedy_pass@1"]]
    every = points[1][0] + 1 if len(points) > 1 else 0
    return (f"Held-out greedy pass@1 during the round (`ppo.val_every: {every}`, `plots/ppo_r1.csv`): "
            f"{points[0][1]:.3f} at the start, then {' / '.join(f'{v:.3f}' for _, v in points[1:])} every {every} "
            "steps. The same params and seed give the same numbers.")


def over_seeds(recipe: str) -> Callable[[], str]:
    def render() -> str:
        rows = _recipes()[recipe]
        gains = [r["gain"] for r in rows]
        return (f"Over seeds {', '.join(str(r['seed']) for r in rows)} (new data, SFT model and round each; "
                f"`examples/{recipe}.yaml`), held-out greedy pass@1 goes from {_spread([r['sft'] for r in rows])} "
                f"after SFT to **{_spread([r['final'] for r in rows])}** after the round: a gain of "
                f"{statistics.mean(gains):+.3f} on average, {min(gains):+.3f} to {max(gains):+.3f} "
                f"({_where(rows)}).")
    return render


def recipes_summary() -> str:
    """One row per recipe in examples/ (the default first): means over the seeds, the mean gain's 95% confidence
    interval and each seed's gain."""
    data = _recipes()
    names = sorted((p.stem for p in (REPO / "examples").glob("*.yaml") if p.stem != "quick"),
                   key=lambda n: (n != "grpo", n))
    lines = ["| recipe | greedy pass@1, SFT -> after RL | gain [95% CI] (each seed) | measured |",
             "| --- | --- | --- | --- |"]
    for name in names:
        rows = data.get(name)
        if not rows:
            lines.append(f"| `{name}` | not measured | | |")
            continue
        gains = [r["gain"] for r in rows]
        each = " / ".join(f"{g:+.3f}" for g in gains)
        sft, final = (statistics.mean(r[k] for r in rows) for k in ("sft", "final"))
        gain = format_stat(t_interval(gains), signed=True)  # Student's t over the seeds, as recipes.md gives it
        lines.append(f"| `{name}` | {sft:.3f} -> {final:.3f} | **{gain}** ({each}) | {_where(rows)} |")
    return "\n".join(lines)


Column = tuple[str, Callable[[dict], str]]
SEED_COLUMNS: list[Column] = [("seed", lambda r: str(r["seed"])), ("SFT greedy pass@1", lambda r: f"{r['sft']:.3f}"),
                              ("after RL", lambda r: f"{r['final']:.3f}"), ("gain", lambda r: f"**{r['gain']:+.3f}**")]


def _arrow(a: str, b: str, digits: int = 3) -> Callable[[dict], str]:
    return lambda r: f"{r[a]:.{digits}f} -> {r[b]:.{digits}f}"


def seed_table(rows: list[dict], columns: list[Column], command: str) -> str:
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows]
    return "\n".join([*lines, "", f"`{command}`: {_where(rows)}."])


def recipe_seeds(key: str, extra: list[Column] = (), recipe: str | None = None) -> Callable[[], str]:
    def render() -> str:
        command = f"python -m bench.recipe_seeds --recipe examples/{recipe or key}.yaml --seeds 1,2,3"
        return seed_table(_recipes()[key], [*SEED_COLUMNS, *extra], command)
    return render


def paired_seeds(key: str, base: str, label: str, base_label: str, command: str) -> Callable[[], str]:
    """Two variants of one recipe seed by seed (``key`` and ``base``: rows of recipes.json from the same seeds, so
    the same data, test problems and, where only the round differs, SFT model): each seed's held-out figures and the
    round's wall seconds and trained tokens per second side by side, then the mean difference of the gains with its
    95% confidence interval and paired t test (rlcore.compare.stats) and the median ratio of the round's speed."""
    def render() -> str:
        data = _recipes()
        rows, base_rows = ({r["seed"]: r for r in data[k]} for k in (key, base))
        seeds = [s for s in rows if s in base_rows]
        lines = [f"| seed | SFT greedy pass@1 | after RL: {label} / {base_label} | gain: {label} / {base_label} | "
                 f"{label} minus {base_label} | round s: {label} / {base_label} | trained tokens/s: {label} / "
                 f"{base_label} |", "|---|---|---|---|---|---|---|"]
        for s in seeds:
            a, b = rows[s], base_rows[s]
            sft = f"{a['sft']:.3f}" if a["sft"] == b["sft"] else f"{a['sft']:.3f} / {b['sft']:.3f}"
            lines.append(f"| {s} | {sft} | {a['final']:.3f} / {b['final']:.3f} | {a['gain']:+.3f} / {b['gain']:+.3f} "
                         f"| **{a['gain'] - b['gain']:+.3f}** | {a['round_s']:.0f} / {b['round_s']:.0f} | "
                         f"{a['trained_tokens_per_s']:.0f} / {b['trained_tokens_per_s']:.0f} |")
        diff = paired_difference({str(s): rows[s]["gain"] for s in seeds}, {str(s): base_rows[s]["gain"] for s in seeds})
        time = statistics.median(rows[s]["round_s"] / base_rows[s]["round_s"] for s in seeds)
        steps = statistics.median(rows[s]["steps_per_s"] / base_rows[s]["steps_per_s"] for s in seeds)
        where = _where([*(rows[s] for s in seeds), *(base_rows[s] for s in seeds)])
        return "\n".join([*lines, "", f"Gain, {label} minus {base_label}: **{format_stat(diff.interval, signed=True)}** "
                          f"(mean [95% CI] over seeds {', '.join(str(s) for s in seeds)}; paired t test p = "
                          f"{format_p(diff.p)}). The round's wall time, {label} over {base_label}: **{time:.2f}x** "
                          f"(median over the seeds; steps per second {steps:.2f}x).", "",
                          f"`{command}`: {where}."])
    return render


def default_recipe_seeds() -> str:
    data = _json(DATA / "default_recipe_seeds.json")
    rows = data["rows"]
    table = seed_table(rows, SEED_COLUMNS, "the stage commands of dvc.yaml, seed by seed")
    gains = [r["gain"] for r in rows]
    return table + (f" All {len(rows)}: min {min(gains):+.3f}, mean {statistics.mean(gains):+.3f}; seeds 1-5: mean "
                    f"{statistics.mean(r['gain'] for r in rows if r['seed'] <= 5):+.3f}.")


def async_table() -> str:
    """The table of the async section of bench/RESULTS.md, as it is, and its ratios."""
    section = sections((REPO / "bench" / "RESULTS.md").read_text())["async"]
    table = re.search(r"^\| workload \|.*?(?=\n\n)", section, re.M | re.S).group(0)
    ratios = re.findall(r"^- (\S+): async/sync samples per second: ([\d.]+)$", section, re.M)
    return table + "\n\nasync/sync samples per second: " + ", ".join(f"**{r}** ({w})" for w, r in ratios) + \
        " (`make bench-async`, `bench/RESULTS.md`)."


BLOCKS: dict[str, Callable[[], str]] = {
    "make-run": make_run_table,
    "make-run-validation": make_run_validation,
    "grpo-over-seeds": over_seeds("grpo"),
    "recipes-summary": recipes_summary,
    "seeds.lora": recipe_seeds("lora"),
    "seeds.rlhf": recipe_seeds("rlhf", [
        ("reward model held-out pairwise accuracy", lambda r: f"{r['rm_accuracy']:.3f}"),
        ("pass@8 SFT -> after", _arrow("pass8_sft", "pass8_final"))]),
    "seeds.calculator": recipe_seeds("calculator", [("minutes", lambda r: f"{r['minutes']:.1f}")]),
    "seeds.calculator-before-budget-rule": recipe_seeds("calculator_before_budget_rule", [
        ("sampled pass@1 SFT -> RL", _arrow("sampled_sft", "sampled_final")),
        ("pass@8 SFT -> RL", _arrow("pass8_sft", "pass8_final")),
        ("tool calls per sample SFT -> RL", _arrow("tool_calls_sft", "tool_calls_final", 2)),
        ("tool errors after RL", lambda r: str(r["tool_errors_final"])),
        ("minutes", lambda r: f"{r['minutes']:.1f}")], recipe="calculator"),
    "seeds.default-11": default_recipe_seeds,
    "async-schedules": paired_seeds("async_fixed_schedule", "async_free_schedule", "fixed", "free",
                                    "python -m bench.recipe_seeds --recipe examples/async.yaml --seeds 1,2,3 "
                                    "[--set ppo.async.schedule=fixed]"),
    "partial-rollouts": paired_seeds("async_long_tail_partial_rollouts", "async_long_tail", "partial", "whole",
                                     "python -m bench.recipe_seeds --recipe examples/async.yaml --seeds 1,2,3 $LONG "
                                     "[--set ppo.async.partial_rollout=true]"),
    "partial-rollouts-switching": paired_seeds(
        "async_long_tail_96_partial_rollouts", "async_long_tail_96", "partial", "whole",
        "python -m bench.recipe_seeds --recipe examples/async.yaml --seeds 1,2,3 $LONG96 "
        "[--set ppo.async.partial_rollout=true]"),
    "distill-vs-grpo": paired_seeds("distill", "distill_grpo", "distill", "GRPO",
                                    "python -m bench.recipe_seeds --recipe examples/distill.yaml --seeds 1,2,3 "
                                    "--copy models/ppo/r1=models/teacher [--set algorithm.adv_estimator=grpo]"),
    "async": async_table,
}


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def rendered(text: str, where: str) -> str:
    """``text`` with every block rendered again; an unknown name is an error naming the file."""
    def one(m: re.Match) -> str:
        if m["name"] not in BLOCKS:
            raise SystemExit(f"{where}: no figures block named {m['name']!r} (bench/figures.py: {', '.join(BLOCKS)})")
        return f"{m.group(1)}{BLOCKS[m['name']]()}\n{m.group(4)}"
    return BLOCK.sub(one, text)


def stale() -> list[str]:
    """The pages whose blocks differ from what their data renders (relative paths)."""
    return [str(p.relative_to(REPO)) for p in pages() if rendered(p.read_text(), str(p)) != p.read_text()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the pages that differ")
    args = ap.parse_args(argv)
    if args.check:
        if names := stale():
            print(f"figures differ from the stored results in: {', '.join(names)} (python -m bench.figures)")
            sys.exit(1)
        return
    for page in pages():
        text = page.read_text()
        if (new := rendered(text, str(page))) != text:
            page.write_text(new)
            print(f"{page.relative_to(REPO)}: written")


if __name__ == "__main__":
    main()
