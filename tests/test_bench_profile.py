"""bench.profile sorts py-spy stacks into buckets by the names of rlcore's functions: every name it looks for must
still be one (a renamed method silently moves its samples to "other": the static engine's decode loop went
uncounted that way), and a stack of the default engine's decode lands in the sampling bucket."""

from __future__ import annotations

import ast
from pathlib import Path

from bench.profile import CONTROLLER_RULES, REWARDS, WORKER_RULES, classify_controller, classify_worker, decompose
from tests.conftest import REPO_ROOT

# names bench.profile matches that belong to other libraries (torch's autograd, Ray's actor handles)
EXTERNAL = {"backward", "ActorMethod._remote"}


def defined_names() -> tuple[set[str], set[str]]:
    """Every function name, and every ``Class.method``, defined in rlcore/ and bench/."""
    functions, methods = set(), set()
    for path in [*(REPO_ROOT / "rlcore").rglob("*.py"), *(REPO_ROOT / "bench").rglob("*.py")]:
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.ClassDef):
                methods.update(f"{node.name}.{f.name}" for f in node.body
                               if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.add(node.name)
    return functions, methods


def test_every_name_a_bucket_rule_looks_for_is_defined_in_the_code_it_profiles():
    functions, methods = defined_names()
    keys = {k for rules in WORKER_RULES.values() for _, ks in rules for k in ks}
    keys |= {k for _, ks in CONTROLLER_RULES for k in ks}
    missing = []
    for key in sorted(keys - EXTERNAL):
        if "." in key:  # a stack frame reads "Class.method (file)": a key may be a suffix of the class name
            cls, meth = key.rsplit(".", 1)
            found = any(m.endswith(f".{meth}") and m[:-len(meth) - 1].endswith(cls) for m in methods) or \
                (cls == "wire" and meth in functions)  # module-level function: py-spy shows "emit (bench/wire.py)"
        else:
            found = key in functions
        if not found:
            missing.append(key)
    assert not missing, f"bench.profile looks for names no code defines: {missing}"


def test_the_static_engines_decode_loop_and_reward_scoring_land_in_their_buckets():
    worker = ["_resume_span (ray/util/tracing/tracing_helper.py)",
              "ActorRolloutRefWorker.generate (rlcore/workers/actor.py)",
              "generate_on (rlcore/workers/rollout.py)", "StaticRolloutEngine.generate (rlcore/rollout/static.py)",
              "Decoder.decode (rlcore/rollout/static.py)"]
    assert classify_worker(worker) == "generate / sampling loop (KV-cache decode)"
    controller = ["RoundRunner.step (rlcore/trainer/round/runner.py)",
                  "score_responses (rlcore/trainer/samples/scoring.py)"]
    assert classify_controller(controller) == REWARDS
    # the controller's scoring runs inside the gen phase: it is reported as rewards, not as Ray's share
    split = decompose({"gen": 2.0, "step": 2.0},
                      {"controller": {REWARDS: 0.25}, "worker0": {"generate / sampling loop (KV-cache decode)": 1.5}})
    assert split["rewards (controller)"] == 0.25
    assert split["generation: sampling loop"] == 1.5
    assert split["Ray dispatch, transfer, rank imbalance"] == 0.25
