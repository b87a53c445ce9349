"""Ray start-up and resource pools (one placement group bundle per rank)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator

import ray
from ray._private import parameter as ray_parameter
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from rlcore.controller.address import check_reachable
from rlcore.errors import ConfigError
from rlcore.heap import RANK_SETUP_HOOK, rank_process_env
from rlcore.kernels import inherited as kernel_env

log = logging.getLogger(__name__)

# params.yaml resources.placement -> Ray placement group strategy. SPREAD is Ray's best effort: the bundles go
# to different nodes while there are nodes to spread over, and share nodes beyond that (STRICT_SPREAD would
# refuse to start more ranks than nodes).
PLACEMENT_STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}
# Ray gives a local node 30 s (fixed in ray/_private/node.py) to register its raylet; on a loaded machine (a load
# average of 10-25 on 2 cores, seen here) that fails now and then, and a stage would end before its first step.
NODE_START_TRIES = 3
NODE_START_TIMEOUT = "timed out during startup"


def init_local(num_cpus: int, *, log_to_driver: bool, **options) -> None:
    """``ray.init`` of a private Ray instance on this machine (never a running ``ray start`` cluster, whatever
    ``RAY_ADDRESS`` says), without the dashboard, its dashboard agent listening on a free port.

    Ray gives every instance's dashboard agent the fixed HTTP port 52365; a second instance on the machine (a
    stage beside a test session's Ray, two pipelines, ``rlcore diagnose`` during a run) finds it taken, retries
    for 3.3 s and gives up, and its node waits for that: ``ray.init`` 14.0 s against 9.6 s with a free port
    (median of 3 each, 2 cores). ``ray.init`` has no setting for that port, so it goes in as Ray's own
    ``RayParams`` default, for this call only.

    Nor does Ray prestart idle worker processes for the driver (``prestart_worker_first_driver``): it starts one per
    CPU, with the default runtime environment, and every rank asks for its own (``OMP_NUM_THREADS``), so none was
    ever used: each cost ~0.6 s of CPU while a stage's ranks were starting and then held 79 MiB (42 MiB its own)
    (measured: a score stage 0.66 -> 0.62 CPU-minutes, 30.1 -> 28.6 s).

    Without ``log_to_driver`` nothing reads what the workers print, and Ray's log monitor (which forwards it) is
    not started: it re-lists the session's log folder ten times a second whether or not anyone listens (measured:
    8.1 CPU-s over a test session's 390 s, the largest share of an idle private instance's 23). ``ray.init`` has no
    setting for it either (``ray start`` has ``--include-log-monitor``). ``options``: more ``ray.init`` arguments
    (``object_store_memory``; a ``runtime_env`` gets :func:`job_runtime_env`'s hook added)."""
    system_config = {"prestart_worker_first_driver": False, **options.pop("_system_config", {})}
    defaults = {"dashboard_agent_listen_port": 0, **({} if log_to_driver else {"include_log_monitor": False})}
    runtime_env = job_runtime_env(options.pop("runtime_env", None))
    with _ray_params_defaults(defaults):
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=log_to_driver,
                 configure_logging=False, _system_config=system_config, runtime_env=runtime_env, **options)


def job_runtime_env(runtime_env: dict | None = None) -> dict:
    """The job-level ``runtime_env`` of every Ray session rlcore starts or joins: ``runtime_env`` (a caller's) with
    :data:`rlcore.heap.RANK_SETUP_HOOK` as Ray's ``worker_process_setup_hook``. Ray runs the hook in each worker
    process it starts for the job, before the process takes its first task or actor; it acts only in a rank's
    process (the variable :func:`rank_env` sets), so the worker modules' imports run as ``rlcore.heap`` says. Ray
    takes the hook at the job level only (an actor's own ``runtime_env`` cannot name one), so it is set here, in
    the driver that owns the session, not as a side effect of importing ``rlcore.workers``."""
    return {**(runtime_env or {}), "worker_process_setup_hook": RANK_SETUP_HOOK}


# held while RayParams.__init__ is replaced: two threads starting Ray at once would otherwise each restore what
# the other put there, and leave the replacement in place for good
_RAY_PARAMS_PATCH = threading.Lock()


@contextlib.contextmanager
def _ray_params_defaults(defaults: dict) -> Iterator[None]:
    """Within it, a ``RayParams`` made without one of ``defaults``' arguments gets the value given here instead of
    Ray's own (``dashboard_agent_listen_port``: 0, a port the system picks, instead of 52365). An argument this
    Ray's ``RayParams`` does not have is left out."""
    cls = ray_parameter.RayParams
    with _RAY_PARAMS_PATCH:
        original = cls.__init__
        known = {k: v for k, v in defaults.items() if k in inspect.signature(original).parameters}
        if not known:
            yield
            return

        def init(self, *args, **kwargs):
            for key, value in known.items():
                kwargs.setdefault(key, value)
            original(self, *args, **kwargs)

        cls.__init__ = init
        try:
            yield
        finally:
            cls.__init__ = original


def _cluster_counts() -> str:
    res = ray.cluster_resources()
    try:
        nodes = f"{sum(1 for n in ray.nodes() if n.get('Alive'))} node(s), "
    except Exception:  # a Ray client (ray://) connection may not list nodes
        nodes = ""
    return f"{nodes}{res.get('CPU', 0):g} CPUs, {res.get('GPU', 0):g} GPUs"


def start_ray(address: str, num_cpus: int) -> str:
    """Start a private local Ray instance or join ``address``; return a line saying which: for a cluster,
    the head's address and dashboard, and for both the nodes, CPUs and GPUs it has."""
    if ray.is_initialized():
        return f"ray: already initialised in this process ({_cluster_counts()})"
    if address == "local":
        # Ray starts its worker processes 15 nice levels below the driver; the ranks do the compute, so on
        # a shared machine they would lose the CPU to everything else. A user's own setting wins.
        os.environ.setdefault("RAY_worker_niceness", "0")
        with _keeping_signal_handlers():
            _start_local(num_cpus)
        return f"ray: started a private Ray instance on this machine: {_cluster_counts()}"
    check_reachable(address)
    try:
        with _keeping_signal_handlers():
            ctx = ray.init(address=address, log_to_driver=True, configure_logging=False,
                           runtime_env=job_runtime_env())
    except ConnectionError as err:
        if address != "auto" or "Could not find any running Ray instance" not in str(err):
            raise
        raise ConfigError("ray.address 'auto': no Ray cluster runs on this machine and RAY_ADDRESS is not set; start "
                          "one (ray start --head, docs/how-to/cluster.md), set ray.address to the head's host:port, "
                          "or set ray.address: local") from None
    info = getattr(ctx, "address_info", None) or {}
    head = info.get("gcs_address") or address
    dashboard = getattr(ctx, "dashboard_url", None)
    where = f"head {head}" + (f", dashboard http://{dashboard}" if dashboard else "")
    return f"ray: joined the cluster at ray.address {address} ({where}): {_cluster_counts()}"


@contextlib.contextmanager
def _keeping_signal_handlers() -> Iterator[None]:
    """Around ``ray.init``: Ray's driver installs C-level handlers for SIGTERM (and SIGINT) that log the signal and
    end the process at once, over the Python handlers the process had; a stage's (``rlcore.interrupt``: finish
    the step in flight, checkpoint, stop the workers) are put back afterwards. In the main thread only, where
    Python handlers live."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            if callable(handler):  # a Python handler (Python's record of it outlives Ray's C-level one)
                signal.signal(sig, handler)


def _start_local(num_cpus: int) -> None:
    """``ray.init`` of a private local instance, tried again (up to :data:`NODE_START_TRIES` times) when its node
    does not come up in Ray's 30 s; the processes a failed try started are killed before the next."""
    for attempt in range(1, NODE_START_TRIES + 1):
        before = descendants(os.getpid())
        try:
            init_local(num_cpus, log_to_driver=True)
            return
        except Exception as err:
            if NODE_START_TIMEOUT not in str(err) or attempt == NODE_START_TRIES:
                raise
            for pid in descendants(os.getpid()) - before:  # the failed try's GCS, raylet, dashboard, agents
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            print(f"ray: the local node did not start within Ray's 30 s (is the machine busy? load average "
                  f"{os.getloadavg()[0]:.1f}); trying again ({attempt + 1}/{NODE_START_TRIES})", file=sys.stderr,
                  flush=True)


def descendants(pid: int) -> set[int]:
    """Process ids of ``pid``'s children, their children and so on (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return set()
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the name, in parentheses, may hold spaces
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


class ResourcePool:
    """``n_workers`` bundles of {CPU: cpus_per_worker (, GPU: 1)}, one per rank, placed as ``placement``
    says (:data:`PLACEMENT_STRATEGIES`: ``pack`` fills a node before the next, ``spread`` puts them on
    different nodes when it can); worker groups may share it. As a context manager it releases its
    placement group on the way out, whatever happened."""

    def __init__(self, n_workers: int, cpus_per_worker: float, use_gpu: bool, timeout_s: float,
                 placement: str = "pack"):
        self.n_workers = n_workers
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.placement = placement
        bundle = {"CPU": cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
        self.pg: PlacementGroup = placement_group([dict(bundle) for _ in range(n_workers)],
                                                  strategy=PLACEMENT_STRATEGIES[placement])
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"resources: {n_workers} bundles of {bundle} did not fit in {timeout_s:g}s; "
                f"cluster has {ray.cluster_resources()} (lower resources.n_workers or cpus_per_worker)"
            ) from None

    def rank_nodes(self) -> list[tuple[str, str]]:
        """``(node id, node IP)`` of each bundle (the rank of that index runs there), from Ray's
        placement group table; the IP is '?' for a node Ray no longer lists."""
        bundles = placement_group_table(self.pg)["bundles_to_node_id"]
        try:
            ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        except Exception:  # a Ray client (ray://) connection may not list nodes
            ips = {}
        return [(bundles[i], ips.get(bundles[i], "?")) for i in range(self.n_workers)]

    def describe(self) -> str:
        """One line: where the ranks were placed (the node of each)."""
        nodes = self.rank_nodes()
        where = ", ".join(f"rank {r} on {ip} (node {nid[:8]})" for r, (nid, ip) in enumerate(nodes))
        return (f"resources: {self.n_workers} rank(s) placed {self.placement} over {len(set(nodes))} node(s): "
                f"{where}")

    def release(self) -> None:
        remove_placement_group(self.pg)

    def __enter__(self) -> "ResourcePool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def rank_env(threads: int) -> dict[str, str]:
    """The environment of a rank's (or generator's) process, Ray's ``runtime_env`` ``env_vars``: its thread count,
    rlcore's mark of a rank process (``rlcore.heap``) and the driver's CPU kernel choice (``rlcore.kernels``; on a
    cluster a worker does not inherit the driver's environment)."""
    return {"OMP_NUM_THREADS": str(threads), **rank_process_env(), **kernel_env()}

