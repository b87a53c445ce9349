"""Numbers from step records, and the markdown written to stdout and bench/RESULTS.md.

FLOPs: N = parameters that do matmuls (all but the input embedding, a lookup). A step
costs 6*N*T for the policy forward+backward plus 2*N*T for each forward-only pass over
the same T tokens (the reference; neither system recomputes old log-probs with one pass
per step), T = prompt + completion tokens of the step (padding not counted). Generation
and attention-score FLOPs are left out (sequences are at most 22 tokens).
"""

from __future__ import annotations

import statistics
from typing import Any

SYSTEMS = ("ours", "trl")
CLEAN_CORES = 0.3  # a step is "clean" when other processes used less than this many cores during it
MIN_CLEAN = 5


def clean(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("foreign_load", 0.0) < CLEAN_CORES]


def choose_steps(measured: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], bool]:
    """The clean steps of each system when both have at least MIN_CLEAN, else all measured steps."""
    picked = {n: clean(r) for n, r in measured.items()}
    if all(len(r) >= MIN_CLEAN for r in picked.values()):
        return picked, True
    return measured, False


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(measured: list[dict], used: list[dict], all_steps: list[dict], n_params: int, fwd_only_passes: int,
              peak_flops: float) -> dict[str, float]:
    """Timing figures over the ``used`` steps; rewards over all steps (warm-up included)."""
    walls = [r["wall_s"] for r in used]
    wall_total = sum(walls)
    train_tokens = sum(r["train_tokens"] for r in used)
    flops = (6 + 2 * fwd_only_passes) * n_params * train_tokens
    last = all_steps[-min(5, len(all_steps)):]
    return {
        "steps": len(used), "measured": len(measured),
        "median_all_s": statistics.median(r["wall_s"] for r in measured),
        "load": statistics.mean(r.get("foreign_load", 0.0) for r in used),
        "median_s": statistics.median(walls), "p25_s": quantile(walls, 0.25), "p75_s": quantile(walls, 0.75),
        "min_s": min(walls), "max_s": max(walls),
        "rollout_tok_s": sum(r["rollout_tokens"] for r in used) / max(sum(r["gen_s"] for r in used), 1e-9),
        "train_tok_s": train_tokens / wall_total,
        "flop_s": flops / wall_total, "mfu": flops / wall_total / peak_flops,
        "reward_first": all_steps[0]["reward"], "reward_last5": statistics.mean(r["reward"] for r in last),
        "reward_mean": statistics.mean(r["reward"] for r in all_steps), "reward_last5_n": len(last),
    }


def generation_efficiency(used: list[dict], n_params: int, shape: dict[str, int], shared: dict, peak_flops: float,
                          bandwidth: float, weight_copies: int) -> dict[str, float]:
    """How close generation runs to this machine's two ceilings, over the ``used`` steps.

    FLOPs: 2 x N per generated token (the matmuls; attention scores left out). Bytes: every decode step
    reads the fp32 weights once per copy of the model (ours: one per rank; TRL: one) and, per row, the
    KV cache up to its context (layers x 2 x kv heads x head size x 4 bytes per position). Decode steps
    per RL step are taken as ``task.max_response_length`` (exact when answers run to the limit, an upper
    bound otherwise), the context of a token as the mean prompt plus half the mean response."""
    gen_s = sum(r["gen_s"] for r in used)
    tokens = sum(r["rollout_tokens"] for r in used)
    prompt_tokens = sum(r["train_tokens"] for r in used) - tokens
    responses = shared["completions_per_step"] * len(used)
    kv_per_position = shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * 4
    context = prompt_tokens / responses + tokens / responses / 2
    weight_bytes = 4 * n_params * weight_copies * shared["max_response_length"] * len(used)
    total_bytes = weight_bytes + tokens * kv_per_position * context
    flop_s, bytes_s = 2 * n_params * tokens / gen_s, total_bytes / gen_s
    return {"flop_s": flop_s, "flop_frac": flop_s / peak_flops, "bytes_s": bytes_s, "bw_frac": bytes_s / bandwidth,
            "tokens_per_step": tokens / len(used), "gen_s_per_step": gen_s / len(used)}


def paired_reward_gap(ours: list[dict], trl: list[dict]) -> tuple[float, float, int]:
    """Mean over steps of ours' reward minus TRL's at the same step (both draw the same prompts at
    each step, so pairing removes the prompts' difficulty from the comparison), its standard error
    and the number of steps."""
    diffs = [o["reward"] - t["reward"] for o, t in zip(ours, trl)]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")
    return statistics.mean(diffs), se, len(diffs)


def fmt_row(label: str, ours: str, trl: str, ratio: str) -> str:
    return f"| {label} | {ours} | {trl} | {ratio} |"


def with_se(summary: dict, completions_per_step: int) -> str:
    """Mean reward of the last steps with its binomial standard error (rewards are 0/1)."""
    p, n = summary["reward_last5"], summary["reward_last5_n"] * completions_per_step
    return f"{p:.3f} ± {(p * (1 - p) / n) ** 0.5:.3f}"


def results_table(s: dict[str, dict], mem: dict[str, dict], total_steps: int, completions: int,
                  records: dict[str, list[dict]]) -> list[str]:
    o, t = s["ours"], s["trl"]
    gap, gap_se, gap_n = paired_reward_gap(records["ours"], records["trl"])
    r = lambda a, b: f"{b / a:.2f}" if a else "n/a"  # noqa: E731  TRL/ours
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    return [
        "| metric | ours (rlcore) | TRL | TRL/ours |", "|---|---|---|---|",
        fmt_row("**seconds per RL step, median**", f"**{o['median_s']:.3f}**", f"**{t['median_s']:.3f}**",
                f"**{r(o['median_s'], t['median_s'])}**"),
        fmt_row("spread: p25-p75 (min-max)", f"{o['p25_s']:.3f}-{o['p75_s']:.3f} ({o['min_s']:.3f}-{o['max_s']:.3f})",
                f"{t['p25_s']:.3f}-{t['p75_s']:.3f} ({t['min_s']:.3f}-{t['max_s']:.3f})", ""),
        fmt_row("steps these figures use (of those measured)", f"{o['steps']} of {o['measured']}",
                f"{t['steps']} of {t['measured']}", ""),
        fmt_row("other processes' CPU during those steps (cores)", f"{o['load']:.2f}", f"{t['load']:.2f}", ""),
        fmt_row("median over all measured steps, noisy ones included", f"{o['median_all_s']:.3f}",
                f"{t['median_all_s']:.3f}", r(o["median_all_s"], t["median_all_s"])),
        fmt_row("rollout tokens/s (completion tokens / rollout time)", f"{o['rollout_tok_s']:,.0f}",
                f"{t['rollout_tok_s']:,.0f}", r(o["rollout_tok_s"], t["rollout_tok_s"])),
        fmt_row("training tokens/s (prompt+completion tokens / step time)", f"{o['train_tok_s']:,.0f}",
                f"{t['train_tok_s']:,.0f}", r(o["train_tok_s"], t["train_tok_s"])),
        fmt_row("training FLOP/s, nominal (fraction of matmul peak)",
                f"{o['flop_s'] / 1e9:.2f} G ({o['mfu']:.2%})", f"{t['flop_s'] / 1e9:.2f} G ({t['mfu']:.2%})",
                r(o["flop_s"], t["flop_s"])),
        fmt_row("peak RSS, whole process tree", mib(mem["total"]["ours"]), mib(mem["total"]["trl"]),
                r(mem["total"]["ours"], mem["total"]["trl"])),
        fmt_row("peak RSS, compute processes only", mib(mem["compute"]["ours"]), mib(mem["compute"]["trl"]),
                r(mem["compute"]["ours"], mem["compute"]["trl"])),
        fmt_row("reward (acc) at step 0", f"{o['reward_first']:.3f}", f"{t['reward_first']:.3f}", ""),
        fmt_row(f"mean reward, last 5 of {total_steps} steps (± 1 s.e.)", with_se(o, completions),
                with_se(t, completions), ""),
        fmt_row(f"mean reward over all {total_steps} steps", f"{o['reward_mean']:.3f}", f"{t['reward_mean']:.3f}", ""),
        fmt_row(f"reward, ours minus TRL at the same step (same prompts), mean of {gap_n} steps ± 1 s.e.",
                f"{gap:+.3f} ± {gap_se:.3f}", "", ""),
    ]


# nominal matrix-product FLOPs of a phase, in units of N x T (T: the step's prompt + completion tokens): generation
# 2 (prefill and decode, one forward per token), rlcore's update 8 (the policy's forward and backward, 6, and the
# reference forward inside it, 2), TRL's policy forward and reference forward 2 each
PHASE_FLOPS = {"gen": 2, "update_actor": 8, "policy_fwd": 2, "ref": 2}


def phase_table(records: dict[str, list[dict]], n_params: int, peak_flops: float) -> list[str]:
    """Mean seconds per phase over the measured steps, as each system times them; for the phases that are matrix
    products (:data:`PHASE_FLOPS`), their nominal FLOP/s and its share of this machine's measured matmul peak."""
    lines = ["| system | phase | mean s/step | share | nominal FLOP/s (of matmul peak) |", "|---|---|---|---|---|"]
    for name, recs in records.items():
        mean = {k: statistics.mean(r["phases"].get(k, 0.0) for r in recs) for k in recs[0]["phases"]}
        tokens = statistics.mean(r["train_tokens"] for r in recs)
        step = mean.pop("step")
        for k, v in sorted(mean.items(), key=lambda kv: -kv[1]):
            rate = PHASE_FLOPS.get(k, 0) * n_params * tokens / v if v > 0 else 0.0
            flops = f"{rate / 1e9:.1f} G ({rate / peak_flops:.0%})" if rate else ""
            lines.append(f"| {name} | {k} | {v:.3f} | {v / step:.0%} | {flops} |")
        rest = step - sum(mean.values())
        lines.append(f"| {name} | rest of step (untimed) | {rest:.3f} | {rest / step:.0%} | |")
    return lines


def profile_tables(prof: dict[str, Any]) -> list[str]:
    step = prof["phases"].get("step", 0.0)
    lines = [f"One profiled step: {step:.3f} s (rlcore `timing_s/step`, mean over the profiled steps; py-spy's "
             f"own CPU use on this 2-core machine makes profiled steps slower than measured ones, so read the "
             f"shares rather than the seconds).", "",
             "| where | s/step | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.3f} | {v / step:.0%} |" for k, v in prof["split"].items()]
    probe = prof.get("ray_probe")
    if probe:
        lo, hi = probe["calls_per_step"] * probe["empty_call_s"], probe["calls_per_step"] * probe["batch_in_out_s"]
        lines += ["", f"Ray measured directly (median of 20 group calls to both ranks via `__ray_call__`): empty "
                  f"call {probe['empty_call_s'] * 1e3:.1f} ms, carrying one step's full Batch in "
                  f"{probe['batch_in_s'] * 1e3:.1f} ms (its tensors alone: {probe['tensors_only_in_s'] * 1e3:.1f} ms), "
                  f"in and back out {probe['batch_in_out_s'] * 1e3:.1f} ms. "
                  f"With {probe['calls_per_step']} group calls per step (generate, update_actor; the reference forward "
                  f"runs inside the update) Ray costs between "
                  f"{lo:.3f} and {hi:.3f} s per step ({lo / step:.0%}-{hi / step:.0%})."]
    lines += ["", "Phase wall times of the profiled steps (rlcore `timing_s/*`, mean per step):", "",
              "| phase | s/step |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in sorted(prof["phases"].items(), key=lambda kv: -kv[1])]
    lines += ["", "py-spy buckets, seconds per step (main thread of each process; worker idle time left out):", "",
              "| process | bucket | s/step |", "|---|---|---|"]
    for proc, buckets in prof["buckets"].items():
        for k, v in sorted(buckets.items(), key=lambda kv: -kv[1]):
            if not k.startswith(("idle", "between")) and v >= 0.001:
                lines.append(f"| {proc} | {k} | {v:.3f} |")
    return lines
