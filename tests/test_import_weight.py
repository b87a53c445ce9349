"""What a process imports before it does anything: every DVC stage, Ray worker and reward scoring process starts
a fresh interpreter, so a heavy import at the top of a shared module is paid by each of them.

* A stage's controller (the trainers) loads no model: transformers' modeling machinery (torch.distributed.tensor,
  torch._dynamo, scipy through transformers.modeling_utils) and FSDP wait for a worker that loads one.
* A reward scoring process (``rlcore.rewards.guard``) and the reward rules need neither torch nor pandas.
* The weight-version actor of asynchronous rounds needs no torch.

(``rlcore --help`` and params validation: tests/commands/test_cli.py, tests/test_config.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import REPO_ROOT

MODEL_MACHINERY = ("transformers.modeling_utils", "torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo",
                   "scipy")


def run_python(script: str) -> str:
    """The last line ``script`` prints, run in a fresh interpreter with ``json`` and ``sys`` imported."""
    proc = subprocess.run([sys.executable, "-c", f"import json, sys\n{script}"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def imported(code: str, watch: tuple[str, ...]) -> list[str]:
    """The modules of ``watch`` in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    return json.loads(run_python(f"{code}\nprint(json.dumps([m for m in {list(watch)!r} if m in sys.modules]))"))


def test_the_trainers_and_the_worker_modules_import_no_model_machinery():
    """One interpreter imports the trainers, then each worker module, and says after each which of the machinery
    modules were loaded: nothing after the last means nothing after any, and a failure names the first import that
    brought some in (one process instead of one per module: each costs ~3 CPU-s of torch and transformers)."""
    steps = ["rlcore.trainer.ppo, rlcore.trainer.sft, rlcore.trainer.score, rlcore.trainer.evaluate, rlcore.trainer.rm",
             "rlcore.workers.actor", "rlcore.workers.generator", "rlcore.workers.critic"]
    code = "seen = {}\n" + "".join(
        f"import {s}\nseen[{s!r}] = [m for m in {list(MODEL_MACHINERY)!r} if m in sys.modules]\n" for s in steps)
    code += "print(json.dumps(seen))"
    seen = json.loads(run_python(code))
    assert list(seen) == steps and seen[steps[-1]] == [], {s: seen[s] for s in steps if seen[s]}


def test_reward_rules_and_the_scoring_process_import_neither_torch_nor_pandas():
    code = "import rlcore.rewards.rule, rlcore.rewards.guard, rlcore.rewards.functions"
    assert imported(code, ("torch", "pandas", "pyarrow", "transformers", "ray", "math_verify")) == []


def test_the_weight_version_actor_imports_neither_torch_nor_the_generator_pool():
    """Ray's process for an actor imports its class's module: the weight-version actor's costs no torch import."""
    assert imported("import rlcore.controller.weight_versions", ("torch", "rlcore.protocol", "numpy")) == []
