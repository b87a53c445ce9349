"""A rank lost in the middle of a call, on the session's Ray: the call ends within seconds with one
WorkerDied naming the group, the rank and the method; the other rank (blocked in a collective with the
dead one) is killed, and the resource pool's placement group is removed on the way out. A worker's own
exception stays what it was. Also: the stage's one line and exit code, and the placement param."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
import torch.distributed as dist
from ray.util import placement_group_table

from rlcore.stage import frame
from rlcore.stage.frame import EXIT_WORKER_DIED, stage_errors
from rlcore.controller import Dispatch, RankPlacement, register
from rlcore.controller.address import check_reachable
from rlcore.controller.resource_pool import ResourcePool
from rlcore.controller.worker_group import DEATH_GRACE_S, WorkerGroup
from rlcore.errors import ConfigError, WorkerDied
from rlcore.workers.rank import RankWorker


class Victim(RankWorker):
    def __init__(self, placement: RankPlacement):
        super().__init__(placement, seed=0)

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def reduce_after(self, pause_s: list[float]) -> float:
        """Rank r sleeps ``pause_s[r]``, then all ranks all-reduce: a rank that is not there blocks the rest."""
        time.sleep(pause_s[self.rank])
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)

    @register(Dispatch.ONE_TO_ALL)
    def fail(self, exit_rank: int | None, exit_after_s: float) -> int:
        """Rank 0 raises at once (a bug); ``exit_rank`` then ends its own process after ``exit_after_s``."""
        if self.rank == exit_rank:
            time.sleep(exit_after_s)
            os._exit(1)
        if self.rank == 0:
            raise ValueError("a bug on rank 0")
        return self.rank


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_a_rank_killed_mid_call_ends_the_call_naming_group_rank_and_method(ray_local):
    with ResourcePool(2, 1.0, False, 60) as pool:
        group = WorkerGroup(Victim, pool, name="victims", timeout_s=60)
        pids = ray.get([w.pid.remote() for w in group.workers])
        # a worker's own exception (a bug) is not a death: it keeps its type, and the group lives on
        start = time.monotonic()
        with pytest.raises(ValueError, match="a bug on rank 0"):
            group.call(Victim.fail, None, 0.0)
        assert time.monotonic() - start < DEATH_GRACE_S  # every rank answered: no grace period spent
        assert group.call(Victim.pid) == pids[0]
        # rank 1 is killed while sleeping; rank 0 is already waiting for it in the all-reduce
        pending = group.submit(Victim.reduce_after, [0.0, 30.0])
        time.sleep(1.0)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(WorkerDied) as info:
            pending.result()
        assert time.monotonic() - killed < 10  # not the 30 s of the sleep, nor the 60 s timeout
        assert (info.value.group, info.value.rank, info.value.method) == ("victims", 1, "reduce_after")
        msg = str(info.value)
        assert msg.startswith("worker group 'victims' rank 1 died during reduce_after (")
        assert f"process {pids[1]} on node " in msg and "\n" not in msg
        assert isinstance(info.value.__cause__, ray.exceptions.RayActorError)  # Ray's own report stays attached
        # the survivor, blocked in the collective, was killed rather than left waiting
        assert wait_gone(pids, within_s=10) == []
    assert placement_group_table(pool.pg)["state"] == "REMOVED"


def test_a_peers_error_that_comes_before_the_death_still_reports_the_death(ray_local):
    """Rank 0's exception reaches the controller first; rank 1's process ends 0.5 s later, within the grace."""
    with ResourcePool(2, 1.0, False, 60) as pool:
        group = WorkerGroup(Victim, pool, name="victims", timeout_s=60)
        pids = ray.get([w.pid.remote() for w in group.workers])
        with pytest.raises(WorkerDied, match=r"^worker group 'victims' rank 1 died during fail \(") as info:
            group.call(Victim.fail, 1, 0.5)
        assert isinstance(info.value.__cause__, ray.exceptions.RayActorError)
        assert wait_gone(pids, within_s=10) == []
    assert placement_group_table(pool.pg)["state"] == "REMOVED"


def test_spread_and_pack_are_rays_placement_strategies(ray_local):
    for placement, strategy in (("spread", "SPREAD"), ("pack", "PACK")):
        with ResourcePool(1, 1.0, False, 60, placement) as pool:
            assert placement_group_table(pool.pg)["strategy"] == strategy
            line = pool.describe()
            node = ray.get_runtime_context().get_node_id()
            assert line == f"resources: 1 rank(s) placed {placement} over 1 node(s): rank 0 on " \
                           f"{ray.util.get_node_ip_address()} (node {node[:8]})"


def test_a_stage_reports_a_dead_worker_in_one_line_with_exit_code_75(capsys, monkeypatch):
    left = []  # the stage leaves Ray before its line (the session's Ray stays up here)
    monkeypatch.setattr(frame, "_leave_ray", lambda: left.append(True))
    with pytest.raises(SystemExit) as info:
        with stage_errors("ppo@r1"):
            raise WorkerDied("actor", 1, "update_actor", "node 10.0.0.5 [0a1b2c3d] lost")
    assert info.value.code == EXIT_WORKER_DIED == 75
    assert left == [True]
    assert capsys.readouterr().err == (
        "ppo@r1: error: worker group 'actor' rank 1 died during update_actor (node 10.0.0.5 [0a1b2c3d] lost); "
        "run the stage again to resume from its last step checkpoint (if it wrote one)\n")


def test_an_address_where_nothing_listens_fails_in_seconds_naming_the_key():
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"^ray.address '127.0.0.1:{port}': nothing answers at 127.0.0.1:{port} "):
        check_reachable(f"127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=rf"^ray.address 'ray://127.0.0.1:{port}': nothing answers"):
        check_reachable(f"ray://127.0.0.1:{port}")
    assert time.monotonic() - start < 5


def test_auto_with_no_cluster_on_the_machine_is_one_line_naming_the_key(monkeypatch):
    """``ray.address: auto`` (examples/two-node.yaml) with no cluster to find: Ray's own ConnectionError (what
    ``ray.init`` raises then, here raised for it: a Ray head of another test may run on this machine) becomes one
    line naming the key and the ways out; any other error of Ray's keeps its traceback."""
    import ray

    from rlcore.controller import resource_pool

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def no_cluster(**kwargs):
        assert kwargs["address"] == "auto"
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                              "setting `--address` flag or `RAY_ADDRESS` environment variable.")

    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(ConfigError) as info:
        resource_pool.start_ray("auto", 2)
    assert str(info.value) == (
        "ray.address 'auto': no Ray cluster runs on this machine and RAY_ADDRESS is not set; start one (ray start "
        "--head, docs/how-to/cluster.md), set ray.address to the head's host:port, or set ray.address: local")
    assert info.value.__cause__ is None and info.value.__suppress_context__

    def refused(**kwargs):
        raise ConnectionError("GCS refused the connection")

    monkeypatch.setattr(ray, "init", refused)
    with pytest.raises(ConnectionError, match="GCS refused"):
        resource_pool.start_ray("auto", 2)

def test_a_stage_pointed_where_nothing_listens_stops_in_one_line_before_its_imports_and_its_mlflow_run(tmp_path):
    """A stage that runs on Ray checks ``ray.address`` with its params: exit 2 and one line naming the key, without
    having imported torch, transformers, Ray or MLflow (seconds of CPU) or opened its MLflow run."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = tmp_path / "params.yaml"
    params.write_text(f"ray: {{address: '127.0.0.1:{port}'}}\ntracking: {{uri: 'sqlite:///{tmp_path}/mlflow.db'}}\n")
    code = ("import sys\nfrom stages.sft import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print(e.code, sorted(m for m in ('torch', 'transformers', 'ray', 'mlflow') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, "--params", str(params), "--data", str(tmp_path / "sft.parquet"),
                           "--out", str(tmp_path / "sft"), "--metrics", str(tmp_path / "m.json")],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "2 []", proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"sft: error: ray.address '127.0.0.1:{port}': nothing answers at 127.0.0.1:{port} (Connection refused); "
        f"start the head node there (ray start --head --port {port}) or set ray.address: local"]
    assert not (tmp_path / "mlflow.db").exists()


SIGTERM_AFTER_RAY = """
import os, signal, sys, time
from rlcore.controller.resource_pool import start_ray
signal.signal(signal.SIGTERM, lambda s, f: (print("the stage's handler", flush=True), sys.exit(0)))
print(start_ray("local", 1), flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("not stopped", flush=True)
"""


def test_a_private_ray_leaves_the_stage_its_own_sigterm_handler():
    """ray.init installs a C-level SIGTERM handler that logs the signal and ends the driver at once, over the
    stage's (rlcore.interrupt: finish the step, checkpoint, stop the workers); start_ray puts the stage's back."""
    proc = subprocess.run([sys.executable, "-c", SIGTERM_AFTER_RAY], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "started a private Ray instance" in proc.stdout and "the stage's handler" in proc.stdout
    assert "SIGTERM received" not in proc.stderr
