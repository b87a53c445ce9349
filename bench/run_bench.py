"""rlcore vs TRL GRPO on this machine: same model, prompts, reward and settings, alternating.

    make bench                                          # installs the `bench` extra, then runs this
    .venv/bin/python -m bench.run_bench                 # full run (default: 2 warm-up + 20 measured steps)
    .venv/bin/python -m bench.run_bench --steps 2 --warmup 1 --no-profile --out /tmp/r.md   # quick check
    .venv/bin/python -m bench.run_bench --configs default,realistic,long    # what `make bench` runs
    .venv/bin/python -m bench.run_bench --set model.tiny.hidden_size=128 --set task.max_response_length=16 \
        --fixture-set sft.steps=50                                           # any other shape

``--set KEY=VALUE`` applies to both systems and to the fixture (model shape under ``model.tiny.*``,
``task.max_response_length``, ``ppo.train_batch_size``, ``rollout.n``, ...); ``--fixture-set`` to the
fixture build only (``sft.steps=20``: a barely trained model whose answers run to the length limit).

The first run builds a fixture in bench/_work (data, tiny model, SFT checkpoint; ~5 min),
later runs reuse it. Each system runs in its own child process (``bench.ours``, ``bench.trl_side``);
they take turns in blocks of ``--block`` steps, alternating who goes first, so drift and
other load on the machine hit both. Writes the report to stdout and ``--out`` (keeping the sections other
benchmarks wrote there: ``bench/sections.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench import machine, report
from bench.children import Child, ChildError
from bench.monitor import LoadMeter, MemoryMonitor
from bench.prepare import ensure_prepared
from bench.profile import profile_ours, pyspy_available
from bench.sections import write_keeping_sections
from bench.settings import (BENCH_DIR, CONFIGS, FIXTURE_SET_ENV, REPO_ROOT, RUN_SIZES, SET_ENV, WORK_DIR, paths,
                            rl_config, shared)
from bench.text import render

QUIET_WAIT_PER_BLOCK_S = 15.0
DEFAULT_SIZES = {"steps": 20, "warmup": 2, "block": 4, "profile_steps": 10}
FWD_ONLY_PASSES = 1  # the reference forward; both skip the old-log-prob forward with one pass per step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--steps", type=int, default=None,
                   help=f"measured RL steps per system (after warm-up; default {DEFAULT_SIZES['steps']}, fewer for the "
                        "configurations of settings.RUN_SIZES)")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"warm-up steps per system, not measured (default {DEFAULT_SIZES['warmup']})")
    p.add_argument("--block", type=int, default=None,
                   help=f"steps a system runs before the other takes its turn (default {DEFAULT_SIZES['block']})")
    p.add_argument("--profile-steps", type=int, default=None,
                   help=f"extra steps of ours run under py-spy (default {DEFAULT_SIZES['profile_steps']})")
    p.add_argument("--memory-steps", type=int, default=2,
                   help="steps of TRL with one rank's batch in one process, for the per-rank memory comparison "
                        "(0: skip it)")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--no-like-for-like", action="store_true",
                   help="run each system at its own defaults only (not also ours with native kernels and TRL with "
                        "rlcore's portable ones)")
    p.add_argument("--quiet-wait", type=float, default=120.0,
                   help="total seconds the run may wait, before blocks, for other processes to go quiet")
    p.add_argument("--nice", type=int, default=None,
                   help="niceness increment for the run, inherited by both systems' processes (default: -10 as "
                        "root, to shield them from other load on the machine; 0 otherwise)")
    p.add_argument("--out", default=str(BENCH_DIR / "RESULTS.md"))
    p.add_argument("--configs", default="default",
                   help=f"comma-separated named configurations to run one after the other ({', '.join(CONFIGS)}); "
                        "make bench runs default,realistic")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                   help="rlcore config for both systems and the fixture, on top of each configuration "
                        "(e.g. model.tiny.hidden_size=256, task.max_response_length=32)")
    p.add_argument("--fixture-set", action="append", default=[], metavar="KEY=VALUE", dest="fixture_sets",
                   help="rlcore config for the fixture build only (e.g. sft.steps=20)")
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra rlcore config for our side only, e.g. resources.n_workers=1 (experiments)")
    return p.parse_args(argv)


def parse_sets(items: list[str]) -> dict:
    """["a.b=1", "c=x"] -> {"a.b": 1, "c": "x"} (values parsed as YAML)."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = yaml.safe_load(value)
    return out


def count_params(model_dir: Path) -> dict[str, int]:
    from safetensors import safe_open

    total = embed = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for k in f.keys():
            n = f.get_slice(k).get_shape()
            size = 1
            for d in n:
                size *= d
            total += size
            embed += size if "embed_tokens" in k else 0
    return {"total": total, "matmul": total - embed}


def model_shape(model_dir: Path) -> dict[str, int]:
    """What the generation byte count needs: layers, KV heads, head size (from the fixture's config.json)."""
    c = json.loads((model_dir / "config.json").read_text())
    heads = c["num_attention_heads"]
    return {"layers": c["num_hidden_layers"], "kv_heads": c.get("num_key_value_heads") or heads,
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads}


def alternate(kids: dict[str, Child], steps: int, block: int, meter: LoadMeter, quiet_budget: float):
    """Measured blocks: A, B / B, A / ... (in ``kids`` order). Each step record gets ``foreign_load``: the
    cores other processes used while it ran. Returns the records and the seconds spent waiting
    for the machine to go quiet before blocks."""
    records = {name: [] for name in kids}
    i, left, waited = 0, steps, 0.0

    def mark(rec: dict) -> None:
        rec["foreign_load"] = meter.stop()
        meter.start()

    names = list(kids)
    while left > 0:
        k = min(block, left)
        for name in (names if i % 2 == 0 else names[::-1]):
            waited += meter.wait_quiet(min(QUIET_WAIT_PER_BLOCK_S, quiet_budget - waited))
            meter.start()
            records[name] += kids[name].run(k, on_step=mark)
        i, left = i + 1, left - k
    return records, waited


def renice(nice: int | None) -> None:
    """Raise this process's priority (inherited by both systems): -10 as root unless told otherwise."""
    os.nice(nice if nice is not None else (-10 if os.geteuid() == 0 else 0))


def describe_run(args: argparse.Namespace) -> dict:
    """Everything about the run that is known before any system starts (and the matmul peak)."""
    prepared = ensure_prepared()  # builds the SFT fixture on a fresh machine; count_params reads it
    cfg = rl_config()
    info = {"machine": machine.describe(), "versions": machine.versions(), "shared": shared(cfg),
            "model_shape": model_shape(paths()["sft"]),
            "params": count_params(paths()["sft"]), "prepare": prepared, "args": vars(args),
            "ours_overrides": parse_sets(args.ours_set),
            "fixture": str(paths()["sft"].relative_to(REPO_ROOT)), "fixture_path": str(paths()["sft"])}
    idle = LoadMeter([])
    idle.start()
    info["peak_flops"] = machine.matmul_flops()
    info["mem_bandwidth"] = machine.memory_bandwidth()
    info["load_during_matmul"] = idle.stop()
    return info


def ours_env(overrides: dict) -> dict[str, str]:
    """Environment of an ours child. Ray starts its workers 15 nice levels below the driver's priority;
    RAY_worker_niceness=0 levels them, so every compute process of both systems runs at one priority
    (rlcore's start_ray does so too, unless the environment says otherwise: pinned here)."""
    return {"BENCH_OURS_SET": json.dumps(overrides), "RAY_worker_niceness": "0"}


def systems(info: dict, total: int, like_for_like: bool) -> list[tuple[str, str, dict[str, str]]]:
    """The children of a run: each system at its own defaults (ours: rlcore's defaults, portable kernels; TRL: its
    libraries' own kernels), and, ``like_for_like``, each with the other's kernels (ours native, TRL portable)."""
    trl = {"BENCH_TOTAL_STEPS": str(total)}
    kids = [("ours", "bench.ours", ours_env(info["ours_overrides"])), ("trl", "bench.trl_side", trl)]
    if like_for_like:
        kids += [("ours_native", "bench.ours", ours_env({**info["ours_overrides"], "resources.cpu_kernels": "native"})),
                 ("trl_portable", "bench.trl_side", {**trl, "BENCH_TRL_KERNELS": "portable"})]
    return kids


def start_children(info: dict, total: int, mem: MemoryMonitor, kids: dict[str, Child], like_for_like: bool) -> None:
    """Start each system's child, one at a time (so their set-ups do not compete), and wait until each is ready."""
    info["setup_s"] = {}
    for name, module, env in systems(info, total, like_for_like):
        kids[name] = Child(name, module, env=env)
        mem.add(name, kids[name].pid)
        info[f"{name}_ready"] = kids[name].expect("ready")
        info["setup_s"][name] = info[f"{name}_ready"]["setup_s"]


def trl_per_rank_memory(steps: int) -> dict | None:
    """TRL with one of our ranks' batch (train_batch_size / n_workers prompts) in one process, ``steps`` steps after a
    warm-up one: its peak memory per phase (the larger over the steps) and after set-up, for the per-rank memory
    comparison. None when skipped or when it fails (the rest of the report stands)."""
    if steps <= 0:
        return None
    child = Child("trl_rank", "bench.trl_side", env={"BENCH_TOTAL_STEPS": str(steps + 1), "BENCH_TRL_PER_RANK": "1"})
    try:
        ready = child.expect("ready")
        records = child.run(steps + 1)
    except (ChildError, OSError) as err:
        print(f"bench: TRL per-rank memory run failed, reporting without it: {err}", file=sys.stderr)
        return None
    finally:
        child.close()
    phases = {k for r in records for k in r.get("memory_mib", {})}
    return {"ready_rss_mib": ready["rss_mib"],
            "memory_mib": {k: max(r["memory_mib"].get(k, 0.0) for r in records) for k in phases}}


def profile_and_probe(ours: Child, steps: int) -> dict | None:
    """The py-spy profile and the Ray probe; a failure here costs the profile, not the measurements."""
    try:
        prof = profile_ours(ours, steps, WORK_DIR / "profile")
        prof["ray_probe"] = ours.probe(reps=20)
        return prof
    except (ChildError, OSError, subprocess.SubprocessError) as err:
        print(f"bench: profile failed, reporting without it: {err}", file=sys.stderr)
        return None


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    renice(args.nice)
    info = describe_run(args)
    info["nice"] = os.nice(0)
    total = args.warmup + args.steps
    mem, kids, prof = MemoryMonitor(), {}, None
    try:
        start_children(info, total, mem, kids, not args.no_like_for_like)
        meter = LoadMeter([c.pid for c in kids.values()])
        warm = {n: kids[n].run(args.warmup) if args.warmup else [] for n in kids}
        measured, info["quiet_wait_s"] = alternate(kids, args.steps, args.block, meter, args.quiet_wait)
        for name in kids:
            if name != "ours":
                kids[name].close()  # nothing else runs while ours is profiled
        if not args.no_profile and pyspy_available():
            prof = profile_and_probe(kids["ours"], args.profile_steps)
    finally:
        for c in kids.values():
            c.close()
        mem.stop()
    info["trl_per_rank"] = trl_per_rank_memory(args.memory_steps)
    n = info["params"]["matmul"]
    used, info["clean_only"] = report.choose_steps(measured)
    info["summary"] = {name: report.summarize(measured[name], used[name], warm[name] + measured[name], n,
                                              FWD_ONLY_PASSES, info["peak_flops"]) for name in kids}
    info["generation"] = {name: report.generation_efficiency(
        used[name], n, info["model_shape"], info["shared"], info["peak_flops"], info["mem_bandwidth"],
        weight_copies=info["ours_ready"]["resources"]["n_workers"] if name.startswith("ours") else 1) for name in kids}
    info.update(memory={"total": mem.peak_total, "compute": mem.peak_compute}, profile=prof,
                records={n: warm[n] + measured[n] for n in kids}, measured=measured, total_steps=total,
                wall_s=time.perf_counter() - started)
    return info


def sized(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """``args`` with the run sizes the command line left out taken from the configuration's (or the defaults)."""
    sizes = {**DEFAULT_SIZES, **RUN_SIZES.get(name, {})}
    out = argparse.Namespace(**{**vars(args), **{k: v for k, v in sizes.items()
                                                 if k in vars(args) and getattr(args, k) is None}})
    out.no_like_for_like = args.no_like_for_like or not sizes.get("like_for_like", 1)
    return out


def configure(name: str, args: argparse.Namespace) -> dict:
    """Point this process and the children it starts at configuration ``name`` (plus --set/--fixture-set)."""
    if name not in CONFIGS:
        raise SystemExit(f"bench: --configs: unknown configuration {name!r}; expected one of {', '.join(CONFIGS)}")
    sets, fixture = CONFIGS[name]
    sets, fixture = {**sets, **parse_sets(args.sets)}, {**fixture, **parse_sets(args.fixture_sets)}
    os.environ[SET_ENV], os.environ[FIXTURE_SET_ENV] = json.dumps(sets), json.dumps(fixture)
    return {"name": name, "sets": sets, "fixture_sets": fixture}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    infos = []
    for name in args.configs.split(","):
        config = configure(name.strip(), args)
        info = run(sized(args, name.strip()))
        info["config"] = config
        infos.append(info)
        (WORK_DIR / f"last_run-{config['name']}.json").write_text(json.dumps(info, indent=1, default=str))
    text = render(infos)
    print(text)
    write_keeping_sections(args.out, text)  # other benchmarks' sections (bench.serve_load) stay


if __name__ == "__main__":
    main()
