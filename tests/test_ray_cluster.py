"""A real two-node Ray cluster on this machine: a head and a second node, each started by `ray start`
with its own CPUs, and a tiny PPO round (the real ``ppo@r1`` stage) joining it with
``resources.placement: spread``.

* Ray's own state (``ray.util.state``, what ``ray list`` shows) has the two ranks on the two nodes, and
  the steps run there give exactly the metrics of the same round on a single node (the session's Ray).
* The second node is lost mid-round (every process its ``ray start`` began is killed): the stage ends
  within 60 s with one line naming the worker group, the rank on that node and the method, exit code 75,
  with its actors dead and its placement group removed; run again, it resumes from its last step
  checkpoint and ends exactly as the uninterrupted single-node round.

The cluster is private to this module: its own temporary folder, ports and auth token. It starts in the
background while the single-node round runs on the session's Ray. Teardown kills exactly the processes
the two ``ray start`` calls began (each runs in a session of its own), whatever happened, never ``ray
stop``, which would stop every Ray on the machine. Selected with ``-m ray_cluster``.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from rlcore.controller.decorator import dispatch_of
from rlcore.workers.actor import ActorRolloutRefWorker
from tests.conftest import REPO_ROOT
from tests.ray_nodes import Nodes, command_line, free_port, kill_session, private_env, session_pids

pytestmark = [pytest.mark.ray_cluster, pytest.mark.integration]

# Ray's own state (ray.util.state: what `ray list` shows), from the head's dashboard, in a process of its own
STATE_QUERY = """
import dataclasses, json, sys
from ray.util import state
address, kinds = sys.argv[1], sys.argv[2:]
print(json.dumps({k: [dataclasses.asdict(s) for s in getattr(state, "list_" + k)(address=address, detail=True,
                                                                                  limit=1000)]
                  for k in kinds}, default=str))
"""
STEPS = 8  # the node is killed after the first of them: the rest outlast the kill by far
PARAMS = {
    "seed": 7,
    "ray": {"timeout_s": 300},  # a worker group's start on a loaded 2-core machine (a lost node is seen in seconds)
    "tracking": {"enabled": False},
    "task": {"max_response_length": 5},
    "resources": {"n_workers": 2, "cpus_per_worker": 1, "placement": "spread"},
    "rollout": {"n": 4},
    "actor": {"ppo_mini_batch_size": 2, "lr": 0.01},
    # the overlong penalty makes shorter responses score better: a random tiny model gets advantages
    "ppo": {"train_batch_size": 4, "rounds": {"r1": {"init": "unused", "steps": STEPS}}, "save_every": 1,
            "val_every": 0, "log_samples": 0, "dapo": {"overlong_buffer": 4}},
}
DIED = re.compile(r"^ppo@r1: error: worker group 'actor' rank (\d) died during (\w+) \((.+)\); "
                  r"run the stage again to resume from its last step checkpoint \(if it wrote one\)$")


@dataclass
class Cluster:
    address: str
    dashboard: str
    env: dict[str, str]
    sids: dict[str, int]
    """The session of each node's ``ray start`` (``head``, ``worker``)."""
    node_ids: dict[str, str]

    def state(self, *kinds: str) -> dict[str, list[dict]]:
        """Ray's own records of each of ``kinds`` (``nodes``, ``actors``, ``placement_groups``)."""
        out = subprocess.run([sys.executable, "-c", STATE_QUERY, self.dashboard, *kinds], env=self.env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)


def start_cluster(nodes: Nodes, tmp: Path) -> Cluster:
    dashboard = free_port()
    address = nodes.start_head(tmp, "--num-cpus", "2", "--include-dashboard", "true",
                               "--dashboard-port", str(dashboard))
    nodes.start("worker", "--address", address, "--num-cpus", "2")
    c = Cluster(address, f"http://127.0.0.1:{dashboard}", nodes.env, nodes.sids, {})
    deadline = time.monotonic() + 30
    while len(alive := [n for n in c.state("nodes")["nodes"] if n["state"] == "ALIVE"]) < 2:
        assert time.monotonic() < deadline, f"the second node never joined: {alive}"
        time.sleep(0.5)
    c.node_ids = {("head" if n["is_head_node"] else "worker"): n["node_id"] for n in alive}
    return c


@pytest.fixture(scope="module")
def cluster_start():
    """The two-node cluster, starting in the background: a Future of the :class:`Cluster`."""
    tmp = Path(tempfile.mkdtemp(prefix="rlc", dir="/tmp"))  # short: Ray's socket paths live under it
    nodes = Nodes(private_env())
    starter = ThreadPoolExecutor(1)
    try:
        yield starter.submit(start_cluster, nodes, tmp)
    finally:
        nodes.kill_all()  # a `ray start` still running ends here; the starter then starts nothing more
        starter.shutdown(wait=True)
        left = nodes.kill_all()
        shutil.rmtree(tmp, ignore_errors=True)
        assert not any(left.values()), f"processes of the test cluster still running: {left}"


@pytest.fixture(scope="module")
def cluster(cluster_start: Future, single_node) -> Cluster:
    """The cluster, once started (the single-node round runs first, while it starts)."""
    return cluster_start.result(timeout=420)  # up to 3 tries of each node's start on a loaded machine


# ------------------------------------------------------------------ the round
@pytest.fixture(scope="module")
def round_inputs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    from rlcore.data.arithmetic import arithmetic_rows
    from rlcore.data.schema import write_rows

    root = tmp_path_factory.mktemp("cluster_round")
    write_rows(arithmetic_rows(n=8, seed=1, split="rl", min_digits=1, max_digits=1, ops=("+",)), root / "rl.parquet")
    return {"root": root, "data": root / "rl.parquet", "init": tiny_model_dir}


def write_params(path: Path, *, address: str, checkpoints: Path) -> Path:
    path.write_text(yaml.safe_dump({**PARAMS, "ray": {**PARAMS["ray"], "address": address},
                                    "checkpoint": {"dir": str(checkpoints)}}))
    return path


def stage_args(inputs: dict[str, Path], params: Path, name: str) -> list[str]:
    out = inputs["root"] / name
    return ["--params", str(params), "--round", "r1", "--init", str(inputs["init"]), "--data", str(inputs["data"]),
            "--rewards", str(inputs["root"]), "--out", str(out / "model"), "--metrics", str(out / "metrics.json"), "--plots", str(out / "plots.csv")]


def run_in_process(inputs: dict[str, Path], params: Path, name: str, monkeypatch) -> dict[str, Path]:
    """The ppo@r1 stage in this process, on the session's private one-node Ray."""
    from stages import ppo

    monkeypatch.setattr(ppo, "REPO_ROOT", REPO_ROOT)  # the code fingerprint of the cluster run's checkpoints
    ppo.main(stage_args(inputs, params, name))
    out = inputs["root"] / name
    return {"plots": out / "plots.csv", "metrics": out / "metrics.json", "model": out / "model"}


def results(rows: list[dict]) -> list[dict]:
    """Metric rows without the measured ones (timings, throughputs, peak memory), which differ between any two runs."""
    return [{k: v for k, v in r.items()
             if not (k.startswith("timing_s/") or k.endswith(("_s", "_mib")) or "per_s" in k)} for r in rows]


def plot_rows(path: Path) -> list[dict]:
    return results(list(csv.DictReader(path.open())))


def weights(model_dir: Path) -> bytes:
    return b"".join(f.read_bytes() for f in sorted(model_dir.glob("*.safetensors")))


@pytest.fixture(scope="module")
def single_node(ray_local, round_inputs):
    """The uninterrupted round on the session's private Ray (one node, both ranks on it)."""
    inputs = round_inputs
    params = write_params(inputs["root"] / "single.yaml", address="local", checkpoints=inputs["root"] / "ck_single")
    with pytest.MonkeyPatch.context() as mp:
        return run_in_process(inputs, params, "single", mp)


@pytest.fixture(scope="module")
def lost_node(cluster, round_inputs):
    """The round on the cluster, its second node killed once the first step checkpoint is written."""
    inputs = round_inputs
    checkpoints = inputs["root"] / "ck_cluster"
    params = write_params(inputs["root"] / "cluster.yaml", address=cluster.address, checkpoints=checkpoints)
    out, err = inputs["root"] / "cluster.out", inputs["root"] / "cluster.err"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "stages.ppo", *stage_args(inputs, params, "cluster")],
                                cwd=REPO_ROOT, env=cluster.env, stdout=o, stderr=e, start_new_session=True)
    try:
        first = checkpoints / "ppo@r1" / "step_00000001" / "controller.pt"
        deadline = time.monotonic() + 120
        while not first.exists():
            assert proc.poll() is None, f"the stage ended before its first checkpoint:\n{err.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no step checkpoint after 120 s"
            time.sleep(0.05)
        assert kill_session(cluster.sids["worker"]) == []
        killed = time.monotonic()
        code = proc.wait(timeout=120)
        ended_after = time.monotonic() - killed
    finally:
        kill_session(proc.pid)  # the stage itself, if a check above gave up on it
    return {"code": code, "ended_after_s": ended_after, "stdout": out.read_text(), "stderr": err.read_text(),
            "plots": inputs["root"] / "cluster" / "plots.csv", "params": params}


def test_spread_ranks_run_on_both_nodes_and_a_lost_node_ends_the_stage_in_one_line(cluster, lost_node, single_node):
    stdout, stderr = lost_node["stdout"], lost_node["stderr"]
    # the stage says which cluster it joined and where each rank went
    assert f"ray: joined the cluster at ray.address {cluster.address} (head {cluster.address}, dashboard " in stdout
    placed = re.search(r"^resources: 2 rank\(s\) placed spread over 2 node\(s\): rank 0 on \S+ \(node (\w{8})\), "
                       r"rank 1 on \S+ \(node (\w{8})\)$", stdout, re.M)
    assert placed, stdout
    # Ray's own state: the two ranks of the actor group ran one on each node
    state = cluster.state("actors", "placement_groups")
    actors = [a for a in state["actors"] if a["class_name"] == "ActorRolloutRefWorker"]
    assert sorted(a["node_id"] for a in actors) == sorted(cluster.node_ids.values())
    worker_rank = [n[:8] for n in placed.groups()].index(cluster.node_ids["worker"][:8])
    # the steps done on the cluster are exactly those of the single-node round
    done = plot_rows(lost_node["plots"])
    assert 1 <= len(done) < STEPS
    assert done == plot_rows(single_node["plots"])[:len(done)]
    # the lost node: one line naming the group, the rank that was there and the method; exit code 75
    assert lost_node["code"] == 75, stderr[-3000:]
    assert lost_node["ended_after_s"] < 60
    last = stderr.strip().splitlines()[-1]
    died = DIED.match(last)
    assert died, stderr[-3000:]
    assert int(died.group(1)) == worker_rank
    assert dispatch_of(getattr(ActorRolloutRefWorker, died.group(2))) is not None  # a worker method
    assert "Traceback" not in stderr
    # nothing of the round is left in the cluster: its actors are dead, its placement group removed
    assert {a["state"] for a in actors} == {"DEAD"}
    assert {pg["state"] for pg in state["placement_groups"]} == {"REMOVED"}
    deadline = time.monotonic() + 10  # and no process of a rank is left on the head node
    while ranks := [p for p in session_pids(cluster.sids["head"])
                    if command_line(p)[:1] and command_line(p)[0].startswith("ray::ActorRolloutRefWorker")]:
        assert time.monotonic() < deadline, f"rank processes still running on the head: {ranks}"
        time.sleep(0.2)


def test_the_rerun_resumes_from_the_checkpoint_and_ends_as_the_single_node_round(lost_node, single_node, round_inputs,
                                                                                   capsys, monkeypatch):
    """Resumed on one node (``ray`` params do not touch a checkpoint's fingerprint): after the cluster's steps,
    the rest run here, and the round's rows, metrics and weights equal the uninterrupted round's."""
    folder = round_inputs["root"] / "ck_cluster" / "ppo@r1"
    newest = max(int(p.name[5:]) for p in folder.glob("step_*") if (p / "controller.pt").is_file())
    params = write_params(round_inputs["root"] / "resume.yaml", address="local",
                          checkpoints=round_inputs["root"] / "ck_cluster")
    resumed = run_in_process(round_inputs, params, "resumed", monkeypatch)
    said = capsys.readouterr()
    assert re.search(rf"^resuming ppo@r1 from step {newest} \(", said.out, re.M), said.err[-2000:]
    assert plot_rows(resumed["plots"]) == plot_rows(single_node["plots"])
    assert len(plot_rows(resumed["plots"])) == STEPS
    metrics = [results([json.loads(m.read_text())])[0] for m in (resumed["metrics"], single_node["metrics"])]
    assert metrics[0] == metrics[1]
    assert weights(resumed["model"]) == weights(single_node["model"])
