"""rlcore.heap: the collector held off and the heap frozen in processes rlcore runs as scripts, and left alone in
anyone else's."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

from rlcore import heap
from rlcore.controller.resource_pool import job_runtime_env
from tests.conftest import REPO_ROOT

# A script that allocates 200,000 long-lived containers in a long_lived block and 200,000 after it, counting the
# collections of each generation as they happen. Run as a stage script does (heap.script) or as a library call.
PROBE = r"""
import gc, json, sys
at_start = gc.get_freeze_count()  # (some interpreters' start-up freezes a few hundred objects of its own)
from rlcore import heap
from rlcore.controller.resource_pool import job_runtime_env
counts = {"block": [0, 0, 0], "after": [0, 0, 0]}
where = ["block"]
gc.callbacks.append(lambda phase, info: phase == "stop" and counts[where[0]].__setitem__(
    info["generation"], counts[where[0]][info["generation"]] + 1))
kept = []
def main():
    enabled_before = gc.isenabled()
    frozen_before = gc.get_freeze_count()
    with heap.long_lived():
        enabled_inside = gc.isenabled()
        kept.extend([i] for i in range(200_000))
        with heap.long_lived():
            pass
        enabled_after_nested = gc.isenabled()
    frozen_after_block = gc.get_freeze_count()
    enabled_after = gc.isenabled()
    where[0] = "after"
    kept.extend([i] for i in range(200_000))
    try:
        with heap.long_lived():
            raise KeyError("x")
    except KeyError:
        pass
    return {"enabled": [enabled_before, enabled_inside, enabled_after_nested, enabled_after, gc.isenabled()],
            "frozen_by_block": frozen_after_block - frozen_before, "counts": counts,
            "tracked_before_exit": len(gc.get_objects())}
result = heap.script(main) if sys.argv[1] == "script" else main()
result["frozen_at_exit"] = gc.get_freeze_count() - at_start
result["tracked_at_exit"] = len(gc.get_objects())
print(json.dumps(result))
"""


def probe(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_script_collects_nothing_inside_its_blocks_freezes_what_they_leave_and_the_heap_at_its_end():
    r = probe("script")
    # off inside the block (the nested one leaves it off), on again after it, and after a block that raised
    assert r["enabled"] == [True, False, False, True, True]
    assert r["counts"]["block"] == [0, 0, 0]  # 200,000 allocations and not one collection of any generation
    assert r["counts"]["after"][0] > 100  # after the block the collector runs as usual (~286 at threshold 700)
    assert r["frozen_by_block"] >= 200_000  # what the block left alive, its 200,000 lists among them
    # when main returned, everything it left was frozen: the interpreter's shutdown collection walks none of it
    assert r["frozen_at_exit"] >= 400_000 and r["tracked_at_exit"] < 1_000


def test_called_as_a_library_the_blocks_leave_the_collector_alone():
    r = probe("library")
    assert r["enabled"] == [True, True, True, True, True]
    assert r["counts"]["block"][0] > 100  # collections ran during the block's allocations as anywhere else
    assert r["frozen_by_block"] == 0 and r["frozen_at_exit"] == 0
    assert r["tracked_at_exit"] >= 400_000


def test_this_process_is_not_owned_so_a_block_here_changes_nothing():
    assert not heap.owned()
    frozen = gc.get_freeze_count()
    with heap.long_lived():
        assert gc.isenabled()
    assert gc.get_freeze_count() == frozen


RANK_PROBE = r"""
import gc, importlib, json, os, sys
at_start = gc.get_freeze_count()
if sys.argv[1] == "hook":  # what Ray runs first in a worker process of a session rlcore began (job_runtime_env)
    module, _, name = os.environ["HOOK"].rpartition(".")
    getattr(importlib.import_module(module), name)()
import rlcore.workers  # what a rank's process imports first, before the worker module's torch
from rlcore import heap
from rlcore.controller.resource_pool import job_runtime_env
loading = [gc.isenabled(), os.environ.get(heap.RANK_PROCESS_ENV)]
junk = [[i] for i in range(50_000)]
heap.rank_ready()
print(json.dumps({"loading": loading, "ready": gc.isenabled(), "frozen": gc.get_freeze_count() - at_start}))
"""


def rank_probe(env: dict, hook: bool = True) -> dict:
    base = {k: v for k, v in os.environ.items() if k != heap.RANK_PROCESS_ENV}
    proc = subprocess.run([sys.executable, "-c", RANK_PROBE, "hook" if hook else "-"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**base, **env, "HOOK": job_runtime_env()["worker_process_setup_hook"]})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_rank_process_loads_without_collections_until_the_rank_is_built_and_hides_the_variable():
    r = rank_probe(heap.rank_process_env())
    assert r["loading"] == [False, None]  # off while loading; the variable already out of the environment
    assert r["ready"] and r["frozen"] >= 50_000


def test_any_other_process_that_runs_the_hook_keeps_its_collector():
    r = rank_probe({})
    assert r["loading"] == [True, None] and r["ready"] and r["frozen"] == 0


def test_importing_the_workers_changes_nothing_in_the_process():
    """Only the setup hook tunes a process: importing ``rlcore.workers`` (with the rank's variable set, without the
    hook) leaves the collector on and the variable in place."""
    r = rank_probe(heap.rank_process_env(), hook=False)
    assert r["loading"] == [True, "1"] and r["ready"] and r["frozen"] == 0


def test_every_ray_session_rlcore_starts_or_joins_names_the_hook_and_keeps_a_callers_runtime_env():
    assert job_runtime_env() == {"worker_process_setup_hook": "rlcore.heap.rank_loading"}
    assert job_runtime_env({"env_vars": {"A": "1"}}) == {"env_vars": {"A": "1"},
                                                         "worker_process_setup_hook": "rlcore.heap.rank_loading"}
