"""Where the test suite's CPU goes: every process's CPU over a run of ``make test``'s pytest command, by kind of
process and by the test that started it.

    .venv/bin/python -m bench.suite_cpu                               # the whole suite, as make test runs it
    .venv/bin/python -m bench.suite_cpu --out /tmp/cpu.md -- tests/test_heap.py -n 0

A sampler reads every process's ``/proc/<pid>/stat`` twice a second (user + system time, its parent, when it was
first seen) and keeps the last value of each; processes that live less than half a second are missed, the rest are
counted to their end less at most half a second. The pytest workers load this module as a plugin (``-p``), which logs
each test's start and end; a process is charged to the test that was running on the worker it descends from when it
was first seen (Ray's workers descend from the raylet of the instance a worker started, the stages from the worker's
``dvc`` or ``subprocess`` call). A worker's own CPU (collection, in-process tests) is reported apart.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.settings import BENCH_DIR

HZ = os.sysconf("SC_CLK_TCK")
LOG_ENV = "RLCORE_SUITE_CPU_LOG"
PYTEST = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]  # as the Makefile's


# ---------------------------------------------------------------------------------------------- the pytest plugin
def pytest_runtest_logstart(nodeid, location):
    _log(nodeid, "start")


def pytest_runtest_logfinish(nodeid, location):
    _log(nodeid, "end")


def _log(nodeid: str, event: str) -> None:
    folder = os.environ.get(LOG_ENV)
    if folder:
        with open(Path(folder) / f"tests-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "id": nodeid, "t": time.time(), "ev": event}) + "\n")


# ---------------------------------------------------------------------------------------------------- the sampler
class Sampler(threading.Thread):
    """{(pid, start tick): [command line, parent pid, CPU seconds, first seen]} for every process on the machine; the
    CPU seconds a process had used before the first pass are not counted."""

    def __init__(self, interval_s: float = 0.5):
        super().__init__(daemon=True)
        self.interval_s, self.seen, self.stop = interval_s, {}, threading.Event()
        self.before: dict[tuple[int, str], float] = {}

    def run(self) -> None:
        first_pass = True
        while not self.stop.is_set():
            now = time.time()
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        stat = f.read()
                    fields = stat[stat.rfind(")") + 2:].split()
                    cpu = (int(fields[11]) + int(fields[12])) / HZ
                    key = (int(pid), fields[19])
                    entry = self.seen.get(key)
                    if entry is None:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                        if first_pass:
                            self.before[key] = cpu
                        cpu -= self.before.get(key, 0.0)
                        self.seen[key] = [cmd or stat[stat.find("(") + 1:stat.rfind(")")], int(fields[1]), cpu, now]
                    else:
                        entry[2] = cpu - self.before.get(key, 0.0)
                        if entry[0].startswith(("ray::IDLE", "/")) or "default_worker" in entry[0]:
                            with open(f"/proc/{pid}/cmdline", "rb") as f:  # a Ray worker names itself after its actor
                                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                            if cmd.startswith("ray::") and not cmd.startswith("ray::IDLE"):
                                entry[0] = cmd
                except (OSError, IndexError, ValueError):
                    continue  # gone between listing and reading
            first_pass = False
            self.stop.wait(self.interval_s)


KINDS = [("exec(eval(sys.stdin", "pytest worker (collection, in-process tests)"),
         ("raylet", "Ray: raylet"), ("gcs_server", "Ray: GCS"), ("log_monitor", "Ray: log monitor"),
         ("dashboard/agent.py", "Ray: dashboard agent"), ("ray::DashboardAgent", "Ray: dashboard agent"),
         ("ray::RuntimeEnvAgent", "Ray: runtime-env agent"), ("runtime_env/agent", "Ray: runtime-env agent"),
         ("dashboard.py", "Ray: dashboard"), ("monitor.py", "Ray: autoscaler monitor"), ("bin/ray start", "`ray start`"),
         ("chromium", "Chromium"), ("bin/dvc", "dvc"), ("mlflow", "MLflow server"), ("uvicorn", "MLflow server")]


def kind(cmd: str) -> str:
    cmd = " ".join(cmd.split())  # a `python -c` script's newlines
    if cmd.startswith("ray::"):
        return "Ray worker: " + cmd.split()[0].split(".")[0][5:]
    for needle, name in KINDS:
        if needle in cmd:
            return name
    stage = re.search(r"-m stages\.(\w+)", cmd)
    if stage:
        return f"stage {stage.group(1)}"
    command = re.search(r"-m rlcore (\w[\w-]*)", cmd)
    if command:
        return f"rlcore {command.group(1)}"
    return "other: " + re.sub(r"/tmp/\S+", "<tmp>", cmd)[:60]


def attribute(seen: dict, log_dir: Path) -> tuple[dict, dict, float]:
    """CPU seconds by kind of process and by test; and the CPU of processes that descend from no worker."""
    procs = {pid: entry for (pid, _), entry in seen.items()}
    events = collections.defaultdict(list)
    for path in log_dir.glob("tests-*.jsonl"):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            events[e["pid"]].append((e["t"], e["ev"], e["id"]))
    for evs in events.values():
        evs.sort()

    def worker_of(pid: int) -> int | None:
        hops = set()
        while pid in procs and pid not in hops:
            if pid in events:
                return pid
            hops.add(pid)
            pid = procs[pid][1]
        return None

    by_kind, by_test, elsewhere = collections.Counter(), collections.Counter(), 0.0
    for pid, (cmd, _, cpu, first) in procs.items():
        by_kind[kind(cmd)] += cpu
        worker = worker_of(pid)
        if worker is None or worker == pid:
            elsewhere += cpu
        elif worker != pid:
            test = "(between tests)"
            for t, event, nodeid in events[worker]:
                if t > first + 0.5:
                    break
                test = nodeid if event == "start" else "(between tests)"
            by_test[test] += cpu
    return by_kind, by_test, elsewhere


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--out", default=str(BENCH_DIR / "_work" / "suite_cpu.md"), help="markdown report to write")
    p.add_argument("--top", type=int, default=30, help="rows of each table (default 30)")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    with tempfile.TemporaryDirectory(prefix="suite-cpu-") as tmp:
        env = {**os.environ, LOG_ENV: tmp, "PYTHONDONTWRITEBYTECODE": "",
               "PYTHONPATH": os.pathsep.join([str(BENCH_DIR.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        sampler = Sampler()
        sampler.start()
        began = time.perf_counter()
        proc = subprocess.run([sys.executable, *PYTEST, "-p", "bench.suite_cpu", *extra], env=env)
        wall = time.perf_counter() - began
        time.sleep(1.0)  # one more sample of what was still ending
        sampler.stop.set()
        sampler.join()
        by_kind, by_test, elsewhere = attribute(sampler.seen, Path(tmp))
    total = sum(by_kind.values())
    lines = [f"# Where the test suite's CPU goes (`python -m bench.suite_cpu {' '.join(argv)}`)", "",
             f"pytest exited {proc.returncode} after {wall:.0f} s on {os.cpu_count()} CPUs; {total:.0f} CPU-s over "
             f"{len(sampler.seen)} processes ({elsewhere:.0f} of them in processes no pytest worker started: the "
             "machine's own and the workers themselves).", "",
             "| kind of process | CPU-s | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.1f} | {v / total:.0%} |" for k, v in by_kind.most_common(args.top) if v >= 0.05]
    lines += ["", "| test (processes it started) | CPU-s |", "|---|---|"]
    lines += [f"| `{k}` | {v:.1f} |" for k, v in by_test.most_common(args.top)]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
