"""The results pages' plots, drawn when the site is built from files the repository commits:

* ``plots/sft.csv`` and ``plots/ppo_r1.csv`` (the default pipeline's curves, written by ``make run``);
* the tables and lists of ``bench/RESULTS.md`` (``make bench``, ``make bench-async``);
* ``docs/results/data/rlhf_seed*.csv`` (the RLHF recipe's rounds, one per seed, from ``bench.recipe_seeds``).

Images, so the pages need no JavaScript and nothing from a network.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

SMOOTHING = 0.6  # the moving average the rollout page and TensorBoard draw


def moving_average(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """TensorBoard's debiased exponential moving average."""
    out, last = [], 0.0
    for i, v in enumerate(values, start=1):
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight**i))
    return out


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def markdown_table(text: str, after: str) -> list[dict[str, str]]:
    """The first Markdown table after the first line that starts with ``after``."""
    lines = text[text.index(after):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    header, body = rows[0], [r for r in rows[1:] if not set("".join(r)) <= set("-: ")]
    return [dict(zip(header, r)) for r in body]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _numbers(rows: list[dict[str, str]], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) not in (None, "", "nan")]
    return [p[0] for p in pts], [p[1] for p in pts]


def default_recipe(root: Path) -> bytes:
    import matplotlib.pyplot as plt

    sft, ppo = read_csv(root / "plots/sft.csv"), read_csv(root / "plots/ppo_r1.csv")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    steps, loss = _numbers(sft, "sft/loss")
    left.plot(steps, loss, color="#bc4c00", alpha=0.3, lw=1)
    left.plot(steps, moving_average(loss, 0.9), color="#bc4c00", lw=2, label="SFT loss (moving average 0.9)")
    left.set(xlabel="SFT step", ylabel="loss", title="SFT (plots/sft.csv)")
    left.legend()
    steps, acc = _numbers(ppo, "rollout/acc")  # the training reward is this accuracy (the rule's 0/1)
    right.plot(steps, acc, color="#0969da", alpha=0.25, lw=1)
    right.plot(steps, moving_average(acc), color="#0969da", lw=2, label="training accuracy = reward (moving average)")
    steps, val = _numbers(ppo, "val/greedy_pass@1")
    right.plot(steps, val, "o-", color="#1a7f37", lw=2, label="held-out greedy pass@1")
    right.set(xlabel="RL step", ylabel="share correct", title="GRPO round ppo@r1 (plots/ppo_r1.csv)")
    right.legend(loc="lower right")
    return _png(fig)


def speed(root: Path) -> bytes:
    import matplotlib.pyplot as plt

    text = (root / "bench/RESULTS.md").read_text()
    configs = [c for c in ("default", "realistic", "long") if f"# Configuration `{c}`" in text]
    fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 3.4), squeeze=False)
    for ax, config in zip(axes[0], configs):
        rows = markdown_table(text[text.index(f"# Configuration `{config}`"):], "## Per-step data")
        steps = [int(r["step"].split()[0]) for r in rows]
        warmup = [s for s, r in zip(steps, rows) if "warm-up" in r["step"]]
        for key, color, label in (("ours s", "#0969da", "rlcore"), ("TRL s", "#bc4c00", "TRL GRPOTrainer")):
            ax.plot(steps, [float(r[key]) for r in rows], "o-", ms=3, color=color, label=label)
        span = "" if not warmup else f" ({min(warmup)} warm-up)" if len(warmup) == 1 else \
            f" ({min(warmup)}-{max(warmup)} warm-up)"
        xlabel = f"RL step{span}"
        ax.set(xlabel=xlabel, ylabel="seconds per step", title=f"configuration `{config}`", ylim=(0, None))
        ax.legend()
    return _png(fig)


def async_rounds(root: Path) -> bytes:
    import matplotlib.pyplot as plt

    text = (root / "bench/RESULTS.md").read_text()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4))
    table = markdown_table(text, "## Asynchronous vs synchronous rounds")
    labels = [f"{r['workload']}\n{r['mode']}" for r in table]
    left.bar(labels, [float(r["samples/s"]) for r in table],
             color=["#0969da" if r["mode"] == "sync" else "#8250df" for r in table])
    left.set(ylabel="samples per second", title="throughput on the same 2 CPUs")
    for workload, mode, points in re.findall(r"^- (default|long-tail) (sync|async): (.+)$", text, re.M):
        pairs = [p.split() for p in points.split(", ")]
        right.plot([float(s.rstrip("s")) for s, _ in pairs], [float(v) for _, v in pairs], "o-" if mode == "sync"
                   else "s--", color="#0969da" if workload == "default" else "#bc4c00", label=f"{workload} {mode}")
    right.set(xlabel="seconds of training", ylabel="rollout accuracy", title="reward against wall-clock time")
    right.legend()
    return _png(fig)


def rlhf(root: Path) -> bytes:
    """Per seed: the reward model's score (the training reward, standardised), the true accuracy of the same samples,
    and how often the reward model ranks a correct sample above an incorrect one of its group."""
    import matplotlib.pyplot as plt

    files = sorted((root / "docs/results/data").glob("rlhf_seed*.csv"))
    fig, axes = plt.subplots(1, len(files), figsize=(4.2 * len(files), 3.4), sharey=True, squeeze=False)
    for ax, path in zip(axes[0], files):
        rows = read_csv(path)
        for key, color, label in (("rollout/reward_mean", "#8250df", "reward model's score (training reward)"),
                                  ("rollout/acc", "#0969da", "true accuracy of the samples"),
                                  ("reward/rm/agreement", "#bc4c00", "reward model ranks correct first")):
            steps, values = _numbers(rows, key)
            ax.plot(steps, values, color=color, alpha=0.2, lw=1)
            ax.plot(steps, moving_average(values, 0.9), color=color, lw=2, label=label)
        steps, val = _numbers(rows, "val/greedy_pass@1")
        ax.plot(steps, val, "o-", color="#1a7f37", lw=2, label="held-out greedy pass@1")
        ax.set(xlabel="RL step", title=path.stem.replace("rlhf_", "").replace("seed", "seed "))
    axes[0][0].legend(loc="lower left", fontsize=7)
    return _png(fig)


def draw_all(root: Path) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    return {"results/img/default-recipe.png": default_recipe(root), "results/img/speed-trl.png": speed(root),
            "results/img/async.png": async_rounds(root), "results/img/rlhf.png": rlhf(root)}
