"""Where one of our RL steps spends its time: py-spy on the controller and both worker ranks.

``profile_ours`` samples the three processes (py-spy, non-blocking, ``--idle``) while the
ours child runs a few extra steps, then sorts every sample of each main thread into a
bucket by the frames on its stack. Phase wall times come from rlcore's own ``timing_s/*``;
the worker buckets say how much of a phase the ranks spent computing, and the rest of the
phase is Ray dispatch, (de)serialisation and transfer of Batches, or waiting.

    used by: .venv/bin/python -m bench.run_bench   (skip with --no-profile)
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil

from bench.monitor import is_ray_worker

RATE = 100  # samples per second per process
WORKER_METHODS = ("generate", "compute_log_prob", "compute_ref_log_prob", "update_actor")

# (bucket, substrings of which one must be on the stack), checked in order, innermost meaning first.
WORKER_RULES = {
    "generate": [("weight sync: gather weights (FSDP) or copy (DDP)", ("rollout_state_dict",)),
                 ("weight sync: load_state_dict", ("load_weights",)),
                 # StaticRolloutEngine.generate (the default engine) or HFRolloutEngine.generate
                 ("sampling loop (KV-cache decode)", ("RolloutEngine.generate",))],
    "compute_ref_log_prob": [("forward", ("response_log_probs",))],
    "compute_log_prob": [("forward", ("response_log_probs",))],
    "update_actor": [("reference forward (colocated reference)", ("ActorRolloutRefWorker._ref_log_probs",)),
                     ("collectives (all_reduce of counts/metrics)", ("all_reduce_sum", "all_reduce_mean")),
                     ("grad clip + AdamW step", ("clipped_step",)),
                     ("backward (incl. any FSDP reduce-scatter)", ("backward",)),
                     ("forward + loss (incl. any FSDP all-gather)", ("_actor_loss",))],
}
REWARDS = "rewards (decode + reward functions)"
CONTROLLER_RULES = [("waiting on workers (ray.get)", ("WorkerGroup._get",)),
                    ("dispatch (.remote: serialise Batch)", ("ActorMethod._remote", "Batch.chunk")),
                    (REWARDS, ("score_responses",)),
                    ("advantages", ("PPOStep._advantages",)),
                    ("metrics", ("rollout_metrics",)),
                    ("other step work (Batch select/union/concat)", ("RoundRunner.step",)),
                    ("between steps (bench harness)", ("next_command", "wire.emit"))]


def pyspy() -> str | None:
    exe = Path(sys.executable).with_name("py-spy")
    return str(exe) if exe.exists() else shutil.which("py-spy")


def pyspy_available() -> bool:
    if pyspy() is None:
        print("bench: py-spy not found; skipping the profile (pip install py-spy)", file=sys.stderr)
        return False
    return True


def worker_pids(root: int) -> list[int]:
    return sorted(p.pid for p in psutil.Process(root).children(recursive=True) if is_ray_worker(p))


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy raw lines ``thread (tid): Name;frame;frame count`` -> main-thread (frames, count)."""
    rows = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if frames and frames[0].endswith("MainThread"):
            rows.append((frames[1:], int(count)))
    return rows


def classify_worker(frames: list[str]) -> str:
    text = ";".join(frames)
    for method in WORKER_METHODS:
        if f"ActorRolloutRefWorker.{method} " in text:
            for bucket, keys in WORKER_RULES.get(method, []):
                if any(k in text for k in keys):
                    return f"{method} / {bucket}"
            return f"{method} / other (Batch split/concat, bookkeeping)"
    if "actor_method_executor" in text or "serializ" in text:
        return "ray task overhead (args/results (de)serialisation)"
    return "idle (waiting for the controller)"


def classify_controller(frames: list[str]) -> str:
    text = ";".join(frames)
    for bucket, keys in CONTROLLER_RULES:
        if any(k in text for k in keys):
            return bucket
    return "other"


def bucket_seconds(path: Path, classify, wall: float) -> dict[str, float]:
    """Seconds per bucket: each bucket's share of the main thread's samples times the sampled wall time."""
    counts: Counter = Counter()
    for frames, n in read_raw(path):
        counts[classify(frames)] += n
    total = sum(counts.values()) or 1
    return {k: v / total * wall for k, v in counts.items()}


def profile_ours(child, steps: int, out_dir: Path) -> dict:
    """Run ``steps`` extra steps of the ours child under py-spy; return phase and bucket times per step."""
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = {"controller": child.pid, **{f"worker{i}": pid for i, pid in enumerate(worker_pids(child.pid))}}
    cmd = [pyspy(), "record", "--rate", str(RATE), "--format", "raw", "--idle", "--threads", "--nolineno",
           "--nonblocking"]
    spies = {name: subprocess.Popen(cmd + ["--pid", str(pid), "-o", str(out_dir / f"{name}.txt")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name, pid in targets.items()}
    time.sleep(1.0)  # let py-spy attach
    start = time.perf_counter()
    records = child.run(steps)
    wall = time.perf_counter() - start
    time.sleep(0.3)
    for spy in spies.values():
        spy.send_signal(signal.SIGINT)
    for spy in spies.values():
        spy.wait(timeout=60)
    sampled = wall + 1.3  # the spies ran from attach to stop
    per_step = {}
    for name in targets:
        classify = classify_controller if name == "controller" else classify_worker
        path = out_dir / f"{name}.txt"
        secs = bucket_seconds(path, classify, sampled) if path.exists() else {}
        per_step[name] = {k: v / steps for k, v in secs.items()}
    phases = Counter()
    for r in records:
        phases.update({k: v / steps for k, v in r["phases"].items()})
    return {"steps": steps, "phases": dict(phases), "buckets": per_step, "records": records,
            "split": decompose(dict(phases), per_step), "files": {n: str(out_dir / f"{n}.txt") for n in targets}}


def decompose(phases: dict[str, float], buckets: dict[str, dict[str, float]]) -> dict[str, float]:
    """One step's wall time split into the categories of the report (seconds per step).

    Worker buckets are averaged over ranks. For each worker phase, the controller's wall time
    minus the ranks' time inside the method is Ray dispatch, transfer and waiting; the
    controller's reward scoring runs inside the gen phase and is taken out of that remainder.
    """
    ranks = [b for name, b in buckets.items() if name.startswith("worker")]
    ctl = buckets.get("controller", {})

    def rank(prefix: str) -> float:
        return sum(sum(v for k, v in b.items() if k.startswith(prefix)) for b in ranks) / max(len(ranks), 1)

    rewards = min(ctl.get(REWARDS, 0.0), phases.get("gen", 0.0))
    worker = {"gen": rank("generate /"), "old_log_prob": rank("compute_log_prob /"),
              "ref": rank("compute_ref_log_prob /"), "update_actor": rank("update_actor /")}
    ray = sum(max(phases.get(p, 0.0) - w, 0.0) for p, w in worker.items()) - rewards
    out = {
        "generation: sampling loop": rank("generate / sampling"),
        "generation: weight sync (DDP copy or FSDP all-gather, load into rollout copy)": rank("generate / weight sync"),
        "generation: other worker work": rank("generate / other"),
        "log-prob recomputation": worker["old_log_prob"],
        "reference forward": worker["ref"] + rank("update_actor / reference forward"),
        "update: forward + loss": rank("update_actor / forward"),
        "update: backward": rank("update_actor / backward"),
        "update: grad clip + optimizer": rank("update_actor / grad clip"),
        "update: metric/count all-reduces + other": rank("update_actor / collectives") + rank("update_actor / other"),
        "Ray dispatch, transfer, rank imbalance": max(ray, 0.0),
        "rewards (controller)": rewards,
    }
    rest = phases.get("step", 0.0) - sum(out.values())
    out["other controller work (advantages, metrics, Batch ops)"] = max(rest, 0.0)
    return out
