"""Process-tree sampling from the parent: peak resident memory and CPU seconds.

Peak RSS of a system = the largest sum of RSS over its process tree seen by a sampler
thread (every 0.2 s). For ours the tree is the controller plus everything under it: the
Ray worker ranks and Ray's own daemons (gcs_server, raylet, agents); the "compute" figure
counts only the controller and the ``ray::`` worker processes. RSS sums count shared
library pages once per process, so they overstate the physical total a little.
"""

from __future__ import annotations

import threading
import time

import psutil

SAMPLE_S = 0.2
QUIET_CORES = 0.3  # other processes using less than this is "quiet"


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


RAY_DAEMONS = {"ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE"}


def is_ray_worker(proc: psutil.Process) -> bool:
    """A Ray actor process doing our work: its title is ``ray::<Class>[.<method>]``, not a Ray daemon."""
    try:
        name = proc.name()
    except psutil.Error:
        return False
    return name.startswith("ray::") and name.split(".")[0] not in RAY_DAEMONS


def is_compute(proc: psutil.Process, root_pid: int) -> bool:
    """The controller itself or one of its Ray worker ranks."""
    return proc.pid == root_pid or is_ray_worker(proc)


def rss_sum(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class MemoryMonitor:
    """Samples the trees of the root pids given to :meth:`add` until :meth:`stop`; keeps peaks per name."""

    def __init__(self):
        self.roots: dict[str, int] = {}
        self.peak_total: dict[str, int] = {}
        self.peak_compute: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def add(self, name: str, pid: int) -> None:
        self.peak_total[name] = self.peak_compute[name] = 0
        self.roots = {**self.roots, name: pid}  # replaced, never mutated: the sampler may be iterating

    def _loop(self) -> None:
        while not self._stop.is_set():
            for name, pid in self.roots.items():
                procs = tree(pid)
                self.peak_total[name] = max(self.peak_total[name], rss_sum(procs))
                compute = [p for p in procs if is_compute(p, pid)]
                self.peak_compute[name] = max(self.peak_compute[name], rss_sum(compute))
            time.sleep(SAMPLE_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class LoadMeter:
    """CPU burnt on this machine by processes outside the benchmark (and hypervisor steal), per interval."""

    def __init__(self, own_roots: list[int]):
        self.own_roots = own_roots

    def _own(self) -> float:
        me = psutil.Process()
        return cpu_seconds([me] + [p for r in self.own_roots for p in tree(r)])

    @staticmethod
    def _busy() -> float:
        """CPU seconds the machine spent on anything, including time the hypervisor gave away (steal)."""
        t = psutil.cpu_times()
        extra = sum(getattr(t, name, 0.0) for name in ("irq", "softirq", "steal"))
        return t.user + t.system + t.nice + extra

    def start(self) -> None:
        self._sys0, self._own0, self._wall0 = self._busy(), self._own(), time.perf_counter()

    def stop(self) -> float:
        """Foreign CPU load over the interval, in cores (0 = nothing else ran, 2 = both cores busy);
        CPU time stolen by the hypervisor counts as foreign."""
        busy = self._busy() - self._sys0
        own = self._own() - self._own0
        return max(0.0, busy - own) / max(time.perf_counter() - self._wall0, 1e-9)

    def wait_quiet(self, budget_s: float, probe_s: float = 1.0) -> float:
        """Wait (at most ``budget_s``) until other processes use < QUIET_CORES; return seconds waited."""
        start = time.perf_counter()
        while time.perf_counter() - start < budget_s:
            self.start()
            time.sleep(probe_s)
            if self.stop() < QUIET_CORES:
                break
        return time.perf_counter() - start
