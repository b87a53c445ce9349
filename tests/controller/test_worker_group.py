"""Tests for rlcore.controller: dispatch modes, the process group, resource pools and Ray start-up.

One two-rank group of a toy worker serves the whole module (actor start-up dominates). The
controller names each worker method on the worker class (``group.call(ToyWorker.square_rows, ...)``);
the dispatch mode declared on the method decides how the call is split and gathered.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import ray
import torch
import torch.distributed as dist

from rlcore.controller import Dispatch, RankPlacement, register, resource_pool
from rlcore.controller.resource_pool import ResourcePool, start_ray
from rlcore.controller.worker_group import WorkerGroup
from rlcore.protocol import Batch, Metrics
from rlcore.workers.rank import RankWorker


@dataclass(frozen=True)
class Offset:
    """A typed settings object, as every worker method takes one."""

    add: float


class ToyWorker(RankWorker):
    """Reports who it is and what it was given; does no model work."""

    def __init__(self, placement: RankPlacement, *, tag: str):
        super().__init__(placement, seed=0)
        self.tag = tag

    @register(Dispatch.DP_COMPUTE)
    def square_rows(self, batch: Batch, spec: Offset) -> Batch:
        n = len(batch)
        return Batch({"sq": batch["x"] ** 2 + spec.add, "rank": torch.full((n,), self.rank), "x": batch["x"]},
                     {"name": batch["name"]})

    @register(Dispatch.DP_UPDATE)
    def summed_rows(self, batch: Batch, spec: Offset) -> Metrics:
        """Each rank sums its rows; the all-reduce makes every rank return the group's total."""
        t = batch["x"].sum().reshape(1) + spec.add
        dist.all_reduce(t)
        return {"total": float(t), "rank": float(self.rank)}

    @register(Dispatch.ONE_TO_ALL)
    def who(self) -> str:
        return f"{self.tag}-{self.rank}"

    @register(Dispatch.ONE_TO_ALL)
    def tick(self, pause_s: float) -> int:
        """Counts its calls, after a pause: calls submitted together still run one after another."""
        time.sleep(pause_s)
        self.ticks = getattr(self, "ticks", 0) + 1
        return self.ticks

    @register(Dispatch.ONE_TO_ALL)
    def echo(self, value, *, scale: int = 1):
        self.last = value * scale
        return {"rank": self.rank, "value": value * scale}

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return float(t.item())

    @register(Dispatch.ONE_TO_ALL)
    def group_info(self) -> dict:
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
                "threads": torch.get_num_threads()}

    def last_value(self):  # not registered: reachable only through the actor handle
        return self.last


@pytest.fixture(scope="module")
def group(ray_local, tmp_path_factory):
    """Started from a folder of its own, not the one Ray started this node in (pytest's), as a stage runs in its
    project while the cluster it joins started elsewhere."""
    home, started_in = os.getcwd(), tmp_path_factory.mktemp("driver_folder")
    pool = ResourcePool(2, 1.0, False, 60)
    os.chdir(started_in)
    try:
        wg = WorkerGroup(ToyWorker, pool, name="toy", timeout_s=60, tag="toy")
    finally:
        os.chdir(home)
    wg.started_in = started_in
    yield wg
    wg.shutdown()
    pool.release()


def test_ranks_work_in_the_folder_the_group_was_started_from(group):
    """Ray starts an actor in its node's folder (wherever `ray start` ran, on a cluster), so a relative path in the
    params (`models/sft`) would name another folder on the ranks than on the driver: a stage that joined a cluster
    started elsewhere wrote its model there and DVC found no output. The ranks work in the driver's folder."""
    cwds = ray.get([w.__ray_call__.remote(lambda self: os.getcwd()) for w in group.workers], timeout=60)
    assert cwds == [str(group.started_in)] * 2 and os.getcwd() != str(group.started_in)


def test_a_rank_on_a_node_without_the_driver_s_folder_says_so_in_one_line(ray_local, tmp_path):
    """A cluster whose nodes do not share the project's file system: the rank stops at its start, naming itself,
    its node and the folder, instead of reading and writing elsewhere."""
    missing = tmp_path / "not-on-this-node"
    actor = ray.remote(ToyWorker).options(num_cpus=0).remote(RankPlacement(0, 1, 1, workdir=str(missing)), tag="t")
    with pytest.raises(ray.exceptions.RayActorError) as err:
        ray.get(actor.who.remote(), timeout=60)
    assert "ToyWorker rank 0 on node " in str(err.value)
    assert f"cannot work in the stage's folder {missing} (No such file or directory)" in str(err.value)


def test_dp_compute_splits_by_rank_in_order(group):
    n = 6
    batch = Batch({"x": torch.arange(n, dtype=torch.float32) - 2.5}, {"name": [f"r{i}" for i in range(n)]})
    out = group.call(ToyWorker.square_rows, batch, Offset(0.5))
    # Rank r gets the r-th contiguous half and the pieces come back in rank order.
    assert out["rank"].tolist() == [0, 0, 0, 1, 1, 1]
    assert out["x"].tolist() == batch["x"].tolist()
    assert out["name"].tolist() == ["r0", "r1", "r2", "r3", "r4", "r5"]
    assert torch.equal(out["sq"], batch["x"] ** 2 + 0.5)  # the spec reached every rank


def test_dp_update_splits_the_batch_and_returns_rank_0s_reduced_result(group):
    batch = Batch({"x": torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0, 30.0])})
    # rank 0 sums 6 + 1, rank 1 sums 60 + 1; both return the all-reduced 68
    assert group.call(ToyWorker.summed_rows, batch, Offset(1.0)) == {"total": 68.0, "rank": 0.0}


def test_dp_compute_refuses_a_batch_that_does_not_split(group):
    with pytest.raises(ValueError, match="3 into 2"):
        group.call(ToyWorker.square_rows, Batch({"x": torch.zeros(3)}, {"name": ["a", "b", "c"]}), Offset(0.0))


def test_one_to_all_sends_the_same_arguments_and_returns_rank_0(group):
    assert group.call(ToyWorker.echo, 21, scale=2) == {"rank": 0, "value": 42}
    assert ray.get([w.last_value.remote() for w in group.workers]) == [42, 42]
    assert group.call(ToyWorker.who) == "toy-0"  # the constructor's keyword reached the ranks


def test_submitted_calls_run_in_order_and_return_without_waiting(group):
    start = time.monotonic()
    pending = [group.submit(ToyWorker.tick, 0.2) for _ in range(3)]
    submitted = time.monotonic() - start
    results = [p.result() for p in pending]
    assert submitted < 0.2  # nothing waited for a rank
    assert results[1] == results[0] + 1 and results[2] == results[0] + 2


def test_only_a_registered_method_of_the_worker_class_can_be_called(group):
    with pytest.raises(TypeError, match="last_value is not a @register-ed method of ToyWorker"):
        group.call(ToyWorker.last_value)

    class Other(RankWorker):
        @register(Dispatch.ONE_TO_ALL)
        def echo(self, value):
            return value

    with pytest.raises(TypeError, match="echo is not a @register-ed method of ToyWorker"):
        group.call(Other.echo, 1)
    with pytest.raises(TypeError, match="first argument must be a Batch"):
        group.call(ToyWorker.square_rows, {"x": [1.0]}, Offset(0.0))


def test_workers_form_one_gloo_group(group):
    assert group.call(ToyWorker.all_reduce_rank) == 3.0
    # Every rank took part and saw the same sum (the group method only shows rank 0's).
    assert ray.get([w.all_reduce_rank.remote() for w in group.workers]) == [3.0, 3.0]
    infos = ray.get([w.group_info.remote() for w in group.workers])
    assert [(i["rank"], i["world"], i["backend"]) for i in infos] == [(0, 2, "gloo"), (1, 2, "gloo")]
    assert [i["threads"] for i in infos] == [1, 1]  # one CPU per bundle -> one torch thread


def test_a_ranks_process_loads_its_modules_without_collections_then_collects_as_usual(group):
    """The group starts each rank's process with ``rlcore.heap.RANK_PROCESS_ENV``: the worker's modules (torch and
    the rest) are frozen when the rank is built, the collector is on again after that, and the variable is gone
    from the rank's environment, so a process the rank starts does not inherit it. transformers' lazy-import table
    comes from rlcore's cache there (``rlcore.import_index``'s finder is installed)."""

    def probe(self):
        import gc
        import subprocess
        import sys

        child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('RLCORE_RANK_PROCESS'))"],
                               capture_output=True, text=True, timeout=60).stdout.strip()
        from rlcore import import_index

        index = any(isinstance(f, import_index._Finder) for f in sys.meta_path)
        return gc.get_freeze_count(), gc.isenabled(), os.environ.get("RLCORE_RANK_PROCESS"), child, index

    for worker in group.workers:
        frozen, enabled, env, child, index = ray.get(worker.__ray_call__.remote(probe), timeout=60)
        assert frozen > 50_000 and enabled  # a process that never froze: 0 (or the few hundred some start-ups freeze)
        assert env is None and child == "None" and index


def test_pool_that_cannot_fit_fails_naming_the_resources(group):
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        ResourcePool(8, 1.0, False, 2)
    assert time.monotonic() - start < 15
    msg = str(info.value)
    assert "8 bundles" in msg and "'CPU': 1.0" in msg and "resources.n_workers" in msg
    # The failed placement group is removed, not left pending in the cluster.
    from ray.util import placement_group_table

    pending = [pg for pg in placement_group_table().values() if pg["state"] == "PENDING"]
    assert not pending


# ------------------------------------------------------------------ start_ray
def test_a_private_ray_s_dashboard_agent_listens_on_a_port_of_its_own(ray_local):
    """Not Ray's fixed 52365, which every other Ray instance on the machine also asks for (a second one waits
    3.3 s for it, then starts without it): a port the system picked, where the agent answers."""
    import socket

    from ray._private import parameter

    (node,) = ray_local.nodes()
    port = node["DashboardAgentListenPort"]
    assert 0 < port != 52365  # -1: the agent could not bind at all
    socket.create_connection((node["NodeManagerAddress"], port), timeout=5).close()
    assert parameter.RayParams(num_cpus=1).dashboard_agent_listen_port == 52365  # Ray's own default is back


IDLE_WORKERS = """
import json, time, psutil
from rlcore.controller.resource_pool import init_local
init_local(2, log_to_driver=False)
time.sleep(4)
print(json.dumps([(p.name(), " ".join(p.cmdline())) for p in psutil.Process().children(recursive=True)]))
"""


def test_a_private_ray_starts_no_idle_workers_that_no_rank_could_use_nor_a_log_monitor_that_no_one_reads():
    """Ray prestarts one idle worker process per CPU for a driver, in the default runtime environment; every rank asks
    for an environment of its own (``OMP_NUM_THREADS``), so those processes only took CPU and memory while the ranks
    started. A private Ray (in a process of its own here: this session's has run tasks) has none, before or after
    they rename themselves ``ray::IDLE``. Started without ``log_to_driver``, it has no log monitor either (the
    process that would forward the workers' output to this driver); Ray's own default is back afterwards."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", IDLE_WORKERS], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    processes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "raylet" in {name for name, _ in processes}
    # (the raylet's own command line names the worker script too)
    workers = [p for p in processes if p[0].startswith("ray::IDLE") or
               (p[0] != "raylet" and "default_worker.py" in p[1])]
    assert workers == []
    assert [cmd for _, cmd in processes if "log_monitor.py" in cmd] == []
    assert any("dashboard/agent.py" in cmd for _, cmd in processes)  # the rest of the node is there
    from ray._private import parameter

    assert parameter.RayParams(num_cpus=1).include_log_monitor is None


def test_two_threads_starting_ray_at_once_take_turns_with_the_agent_port_default_and_leave_ray_s_own():
    """The default is swapped on Ray's class for the length of a start: a second thread waits for the first to put
    it back (without that, each restores what the other swapped in, and the swap stays for good)."""
    import threading

    from ray._private import parameter

    original = parameter.RayParams.__init__
    first_in, release, second_in = threading.Event(), threading.Event(), threading.Event()

    def first():
        with resource_pool._ray_params_defaults({"dashboard_agent_listen_port": 0}):
            first_in.set()
            release.wait(10)

    def second():
        first_in.wait(10)
        with resource_pool._ray_params_defaults({"dashboard_agent_listen_port": 0}):
            second_in.set()
            assert parameter.RayParams(num_cpus=1).dashboard_agent_listen_port == 0

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    assert first_in.wait(10) and not second_in.wait(0.5)  # the second waits while the first is inside
    release.set()
    for t in threads:
        t.join(10)
    assert second_in.is_set() and parameter.RayParams.__init__ is original


NICENESS = "RAY_worker_niceness"


@pytest.fixture
def fake_ray(monkeypatch) -> list[dict]:
    """ray.init records its address, the workers' niceness it would see and the job's setup hook; nothing
    starts."""
    calls = []
    monkeypatch.setattr(resource_pool.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(resource_pool.ray, "init", lambda address, runtime_env=None, **_: calls.append(
        {"address": address, "niceness": os.environ.get(NICENESS),
         "hook": (runtime_env or {}).get("worker_process_setup_hook")}))
    monkeypatch.setattr(resource_pool.ray, "cluster_resources", lambda: {})
    monkeypatch.setenv(NICENESS, "")  # so that the variable's original state comes back after the test
    monkeypatch.delenv(NICENESS)
    return calls


def test_a_local_ray_starts_workers_at_the_drivers_priority(fake_ray):
    start_ray("local", 2)
    assert fake_ray == [{"address": "local", "niceness": "0", "hook": "rlcore.heap.rank_loading"}]


def test_the_users_worker_niceness_wins(fake_ray, monkeypatch):
    monkeypatch.setenv(NICENESS, "5")
    start_ray("local", 2)
    assert fake_ray[0]["niceness"] == "5"


def test_joining_a_cluster_leaves_worker_niceness_alone_and_names_the_setup_hook(fake_ray):
    start_ray("auto", 2)
    assert fake_ray == [{"address": "auto", "niceness": None, "hook": "rlcore.heap.rank_loading"}]


def test_a_local_node_that_times_out_starting_is_started_again_and_the_failed_trys_processes_killed(
        monkeypatch, capsys):
    """Ray's own 30 s for a node to come up can pass on a loaded machine: the start is tried again, and what the
    failed try left running (here a stand-in for its GCS) is killed first. Another error is not retried."""
    import subprocess

    monkeypatch.setattr(resource_pool.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(resource_pool.ray, "cluster_resources", lambda: {"CPU": 2.0})
    left = []

    def init(address, **_):
        if not left:
            left.append(subprocess.Popen(["sleep", "60"]))  # started by the failed try, like Ray's GCS
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(resource_pool.ray, "init", init)
    assert start_ray("local", 2).startswith("ray: started a private Ray instance")
    assert left[0].wait(timeout=10) == -9  # SIGKILLed before the second try
    err = capsys.readouterr().err
    assert "did not start within Ray's 30 s" in err and "trying again (2/3)" in err

    def failing(address, **_):
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(resource_pool.ray, "init", failing)
    with pytest.raises(Exception, match="timed out during startup"):  # three tries, then Ray's own error
        start_ray("local", 2)
    assert capsys.readouterr().err.count("trying again") == 2

    def broken(address, **_):
        raise ValueError("another problem")

    monkeypatch.setattr(resource_pool.ray, "init", broken)
    with pytest.raises(ValueError, match="another problem"):
        start_ray("local", 2)
    assert "trying again" not in capsys.readouterr().err
