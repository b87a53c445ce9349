"""A controller call can be followed to the worker method by a type checker, not only by a reader.

``WorkerGroup.call(Worker.method, *args)`` and ``GeneratorPool.submit(GeneratorWorker.method, *args)`` are
typed from the method (``ParamSpec``): mypy checks every call site of the trainers against the worker
methods' signatures and return types, and refuses a call that passes the wrong settings object.
"""

from __future__ import annotations

import subprocess
import sys

from ..conftest import REPO_ROOT


def mypy(*paths: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir", "/dev/null", *paths],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


WRONG_CALLS = '''
from rlcore.controller.worker_group import WorkerGroup
from rlcore.protocol import Batch
from rlcore.workers.actor import ActorRolloutRefWorker, LogProbSpec
from rlcore.workers.critic import ValuesSpec
from rlcore.controller.generator_pool import GeneratorPool, WorkItem
from rlcore.workers.generator import GeneratorWorker
from rlcore.workers.rollout import GenerateSpec


def right(group: WorkerGroup[ActorRolloutRefWorker], batch: Batch) -> Batch:
    return group.call(ActorRolloutRefWorker.compute_log_prob, batch, LogProbSpec(8))


def wrong_settings(group: WorkerGroup[ActorRolloutRefWorker], batch: Batch) -> Batch:
    return group.call(ActorRolloutRefWorker.compute_log_prob, batch, ValuesSpec(8))


def wrong_result(group: WorkerGroup[ActorRolloutRefWorker], batch: Batch) -> float:
    return group.call(ActorRolloutRefWorker.compute_log_prob, batch, LogProbSpec(8))


def generator_right(pool: GeneratorPool[GeneratorWorker], item: WorkItem, spec: GenerateSpec) -> None:
    pool.submit(GeneratorWorker.generate_item, item, spec)


def generator_wrong_settings(pool: GeneratorPool[GeneratorWorker], item: WorkItem) -> None:
    pool.submit(GeneratorWorker.generate_item, item, ValuesSpec(8))
'''


def test_every_controller_to_worker_call_type_checks():
    proc = mypy("rlcore/trainer", "rlcore/controller", "rlcore/workers")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no issues found" in proc.stdout


def test_a_call_with_the_wrong_settings_or_result_type_is_caught(tmp_path):
    snippet = tmp_path / "calls.py"
    snippet.write_text(WRONG_CALLS)
    out = mypy(str(snippet)).stdout
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert len(errors) == 3, out
    assert "calls.py:16:" in errors[0] and '"ValuesSpec"; expected "LogProbSpec"' in errors[0]
    assert "calls.py:20:" in errors[1] and 'got "Batch", expected "float"' in errors[1]
    assert "calls.py:28:" in errors[2] and '"ValuesSpec"; expected "GenerateSpec"' in errors[2]
