"""Shared fixtures: one private Ray instance and one tiny model folder per test session.

Both are lazy: a test module that asks for neither never starts Ray or builds a model.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlcore import import_index, kernels

# before any test module imports transformers: its lazy-import table from rlcore's cache (rlcore/import_index.py),
# as in the processes rlcore runs
import_index.install()
# before any test module imports torch: the CPU kernels of resources.cpu_kernels' default (rlcore/kernels.py), as the
# stages and their workers compute with, so that a round run in a test's own process and the same round run as a
# stage (or on a worker group this process starts) give the same bits
kernels.pin("portable")
kernels.activate()

REPO_ROOT = Path(__file__).resolve().parents[1]

# `make test` runs the suite on two pytest-xdist workers, a test file at a time each (--dist loadfile: a module's
# fixtures, such as the end-to-end pipeline, are built once). The files that take longest go first, so that the
# two workers finish together instead of one of them ending on a long file alone. Only the order changes; a
# file missing from this list runs after them, in the usual order.
# The end-to-end files share one first `dvc repro` (tests/test_e2e_pipeline.py's first_repro) and its Ray head: they
# run on one worker, one after the other (pytest_xdist_make_scheduler below).
LONGEST_FIRST = (
    "test_e2e_pipeline.py", "test_e2e_experiments.py", "trainer/test_async_ppo.py", "engine/test_data_parallel.py",
    "test_ray_cluster.py", "trainer/test_ppo_estimators.py", "trainer/test_resume.py", "controller/test_worker_death.py",
    "trainer/test_reward_model_scoring.py", "engine/test_reward_model.py", "test_pipeline_spec.py",
    "commands/test_serve_abuse.py", "commands/test_generate.py", "controller/test_typed_calls.py",
    "commands/test_diagnose.py", "controller/test_worker_group.py",
)


def pytest_configure(config):
    # A run stopped with SIGTERM (`timeout`, a CI job's cancel; `timeout` signals the xdist workers too) ends as
    # Ctrl-C does: pytest tears the session's fixtures down, so the Ray head `ray_head` started (a `ray start` in a
    # session of its own, which the signal does not reach) is killed with it, instead of living on without a driver.
    signal.signal(signal.SIGTERM, _interrupted)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        rel = Path(str(item.fspath)).relative_to(REPO_ROOT / "tests").as_posix()
        return rank.get(rel, len(rank))

    items.sort(key=key)  # stable: the usual order within a file and among the files not listed


# files that pytest-xdist's --dist loadfile hands to one worker as one unit: the second end-to-end file would
# otherwise start a Ray head of its own on the other worker (about 20 CPU-s with the CPU its daemons take while it
# lives) and wait there for the first `dvc repro`
SAME_WORKER = {"tests/test_e2e_experiments.py": "tests/test_e2e_pipeline.py"}


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SAME_WORKER.get(scope, scope)

    return Scheduling(config, log)


# A model small enough that a forward pass is a millisecond on CPU.
TINY_SHAPE = dict(arch="llama", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                  max_position_embeddings=64)


@pytest.fixture(scope="session")
def ray_local():
    """A private two-CPU Ray instance (never a running `ray start` cluster), shut down at the end."""
    import ray

    if ray.is_initialized():  # another module's code (start_ray) got there first: share it
        yield ray
        return
    from rlcore.controller.resource_pool import init_local

    init_local(2, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_head() -> Iterator[dict[str, str]]:
    """A single-node Ray cluster (`ray start --head`, 2 CPUs) for stage subprocesses to join with ``ray.address:
    auto``: the environment that points them at it (its address and private auth token). A stage that starts a
    private Ray instance of its own spends about 10 s of its run on Ray's start and shutdown (the tiny pipeline's
    score stage: 23 s, 13 s joining a running head, the same output); the end-to-end files run about ten of them.
    Its workers run at the driver's niceness, as a private instance's do; it is killed with its session at the end
    (never `ray stop`, which would stop every Ray on the machine)."""
    from tests.ray_nodes import Nodes, private_env

    tmp = Path(tempfile.mkdtemp(prefix="rlh", dir="/tmp"))
    nodes = Nodes(private_env(RAY_worker_niceness="0", RAY_prestart_worker_first_driver="0"))
    try:
        address = nodes.start_head(tmp, "--num-cpus", "2", "--include-dashboard", "false")
        auth = {k: nodes.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_USAGE_STATS_ENABLED")}
        yield {**auth, "RAY_ADDRESS": address}
    finally:
        left = nodes.kill_all()
        shutil.rmtree(tmp, ignore_errors=True)
        assert not any(left.values()), f"processes of the test head still running: {left}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A Hugging Face folder (weights + char tokenizer) of a one-layer Llama."""
    from rlcore.engine.tiny_model import materialize_tiny

    return materialize_tiny(tmp_path_factory.mktemp("tiny"), seed=0, **TINY_SHAPE)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from rlcore.engine.model import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def mlflow_store_dir(tmp_path_factory) -> Path:
    """A folder whose ``runs.db`` is one sqlite MLflow store shared by the tracking tests (creating its schema is
    the slow part: 3-5 s)."""
    return tmp_path_factory.mktemp("tracking")
