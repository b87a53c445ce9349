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

import pytest

from .conftest import REPO_ROOT

MODEL_MACHINERY = ("transformers.modeling_utils", "torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo",
                   "scipy")


def imported(code: str, watch: tuple[str, ...]) -> list[str]:
    """The modules of ``watch`` in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    script = f"import json, sys\n{code}\nprint(json.dumps([m for m in {list(watch)!r} if m in sys.modules]))"
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_trainers_import_no_model_machinery():
    code = ("import rlcore.trainer.ppo, rlcore.trainer.sft, rlcore.trainer.score, rlcore.trainer.evaluate, "
            "rlcore.trainer.rm")
    assert imported(code, MODEL_MACHINERY) == []


@pytest.mark.parametrize("module", ["rlcore.workers.actor", "rlcore.workers.generator", "rlcore.workers.critic"])
def test_a_worker_module_defers_model_machinery_to_loading_a_model(module):
    assert imported(f"import {module}", MODEL_MACHINERY) == []


def test_reward_rules_and_the_scoring_process_import_neither_torch_nor_pandas():
    code = "import rlcore.rewards.rule, rlcore.rewards.guard, rlcore.rewards.functions"
    assert imported(code, ("torch", "pandas", "pyarrow", "transformers", "ray", "math_verify")) == []


def test_the_weight_version_actor_imports_neither_torch_nor_the_generator_pool():
    """Ray's process for an actor imports its class's module: the weight-version actor's costs no torch import."""
    assert imported("import rlcore.controller.weight_versions", ("torch", "rlcore.protocol", "numpy")) == []
