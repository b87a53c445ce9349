"""dvc.yaml agrees with the stage scripts, so DVC re-runs exactly what a change touches.

* each stage's ``params`` list is its script's ``PARAMS`` (what ``stage_config`` lets it read);
* every path its ``cmd`` passes is a declared dep (inputs) or out/metric/plot (outputs), and back;
* every rlcore module a stage loads is under one of its declared deps, checked by importing the
  stage (and the rlcore modules its main() imports) in a fresh interpreter and loading a config, then listing ``sys.modules``.
"""

from __future__ import annotations

import importlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlcore.stage.frame import DeclaredConfig
from rlcore.config import Config

from .conftest import REPO_ROOT

# dvc.yaml stage -> the stage script it runs (python -m stages.<script>)
SCRIPTS = {"check_params": "check_params", "task_file": "track", "reward_file": "track", "tool_file": "track",
           "agent_file": "track", "prepare": "prepare", "sft": "sft", "rm": "rm", "score": "score", "ppo": "ppo",
           "evaluate": "evaluate"}
STAGES = list(SCRIPTS)
CONFIG_STAGES = [name for name in STAGES if SCRIPTS[name] != "track"]  # the stages that read params.yaml
INPUT_FLAGS = {"--data", "--init", "--teacher", "--model", "--sft", "--final", "--val-data", "--file", "--inputs", "--rewards", "--tools",
               "--train", "--test"}
OUTPUT_FLAGS = {"--out", "--out-dir", "--samples", "--problems", "--rollouts", "--manifest"}  # declared under outs
NON_PATH_FLAGS = {"--round", "--name"}
# check_params reads dvc.yaml itself, which DVC refuses as a dependency (a change to it changes the stages anyway)
PIPELINE_FLAGS = {"--pipeline": "dvc.yaml"}
# check_params's output: a dep of every stage that reads params.yaml so that DVC runs check_params first (a misspelt
# key stops the pipeline before DVC deletes any stage's outputs); no stage reads it
ORDER_ONLY_DEPS = {"inputs/params.json"}


def dvc_stages() -> dict[str, dict]:
    """name -> stage body (the ``do`` part of a foreach stage)."""
    raw = yaml.safe_load((REPO_ROOT / "dvc.yaml").read_text())["stages"]
    return {name: body.get("do", body) for name, body in raw.items()}


def entries(items: list) -> list[str]:
    """Paths of a deps/outs/metrics/plots list, whose items are strings or {path: options}."""
    out = []
    for item in items or []:
        out.extend(item if isinstance(item, dict) else [item])
    return out


def cmd_args(stage: dict) -> tuple[str, dict[str, str]]:
    """(module, {flag: value}) of ``python -m <module> --flag value ...``."""
    words = shlex.split(stage["cmd"])
    assert words[:2] == ["python", "-m"], stage["cmd"]
    flags = words[3:]
    assert len(flags) % 2 == 0 and all(f.startswith("--") for f in flags[::2]), stage["cmd"]
    return words[2], dict(zip(flags[::2], flags[1::2]))


def test_dvc_yaml_has_every_stage():
    assert list(dvc_stages()) == STAGES


@pytest.mark.parametrize("name", CONFIG_STAGES)
def test_declared_params_are_the_sections_the_script_reads(name):
    stage = dvc_stages()[name]
    params = importlib.import_module(f"stages.{name}").PARAMS
    assert len(set(params)) == len(params)
    for name_ in params:  # a section, or a part of one ("rollout.agent")
        model = Config
        for part in name_.split("."):
            assert part in model.model_fields, name_
            model = model.model_fields[part].annotation
    if stage["params"] == [{"params.yaml": None}]:  # the whole file
        assert set(params) == set(Config.model_fields), "a stage declaring all of params.yaml reads all of it"
    else:
        assert stage["params"] == list(params)


def test_evaluate_declares_the_whole_params_file():
    assert dvc_stages()["evaluate"]["params"] == [{"params.yaml": None}]


@pytest.mark.parametrize("name", STAGES)
def test_cmd_paths_are_declared_deps_and_outs(name):
    stage = dvc_stages()[name]
    module, args = cmd_args(stage)
    assert module == f"stages.{SCRIPTS[name]}"
    deps = entries(stage.get("deps"))
    outputs = {"outs": entries(stage.get("outs")), "metrics": entries(stage.get("metrics")),
               "plots": entries(stage.get("plots"))}
    assert f"stages/{SCRIPTS[name]}.py" in deps
    for flag, value in args.items():
        if flag in INPUT_FLAGS:
            assert value in deps, f"{name}: input {flag} {value} is not a dep"
        elif flag in OUTPUT_FLAGS:
            assert value in outputs["outs"], f"{name}: output {flag} {value} is not an out"
        elif flag in PIPELINE_FLAGS:
            assert value == PIPELINE_FLAGS[flag] and value not in deps, f"{name}: {flag} {value}"
            continue
        elif flag in ("--metrics", "--plots"):
            assert value in outputs[flag[2:]], f"{name}: {flag} {value} is not declared under {flag[2:]}"
        else:
            assert flag in NON_PATH_FLAGS, f"{name}: unknown flag {flag}; classify it in this test"
    # And back: every declared output, and every dep outside the code, is passed on the command line,
    # so no path is hard-coded in a script.
    passed = set(args.values()) - set(PIPELINE_FLAGS.values())
    for kind, paths in outputs.items():
        for p in paths:
            assert p in passed, f"{name}: {kind} {p} is not passed in cmd"
    for d in deps:
        if not d.startswith(("rlcore/", "stages/")) and d not in ORDER_ONLY_DEPS:
            assert d in passed, f"{name}: dep {d} is not passed in cmd"


@pytest.mark.parametrize("name", [n for n in CONFIG_STAGES if n != "check_params"])
def test_every_stage_that_reads_params_runs_after_check_params(name):
    assert ORDER_ONLY_DEPS <= set(entries(dvc_stages()[name].get("deps")))
    assert ORDER_ONLY_DEPS <= set(entries(dvc_stages()["check_params"].get("outs")))


@pytest.mark.parametrize("name", STAGES)
def test_declared_code_deps_exist(name):
    written = {o for stage in dvc_stages().values() for o in entries(stage.get("outs"))}  # made by a stage first
    for d in entries(dvc_stages()[name].get("deps")):
        if d.startswith(("rlcore/", "stages/", "inputs/")) and d not in written:
            assert (REPO_ROOT / d).exists(), f"{name}: dep {d} does not exist"


# A fresh interpreter loads the heavy third-party libraries once, then forks one child per stage:
# the child imports the stage and validates a full config (validators import registries lazily),
# and reports the files of the rlcore modules it ended up with.
MODULES_SCRIPT = r"""
import ast, importlib, json, os, sys
import numpy, pandas, pyarrow.parquet, pydantic, yaml, torch, torch.distributed.fsdp, ray  # noqa: F401
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
names, raw, config_free = sys.argv[1].split(","), json.loads(sys.argv[2]), sys.argv[3].split(",")
loop_readers = sys.argv[4].split(",")
result = {}
for name in names:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            stage = importlib.import_module("stages." + name)
            # stages import their trainer inside main(), after validating params: load those too
            for node in ast.walk(ast.parse(open(stage.__file__).read())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlcore"):
                    importlib.import_module(node.module)
            if name not in config_free:
                from rlcore.config import parse_config
                parse_config(raw)
            # a worker imports some modules inside its methods, when rollout.agent.loop asks for them (the openai
            # loop and its server): in a stage that reads that key they may run in its workers, so load those too
            workers = [m for k, m in list(sys.modules.items()) if k.startswith("rlcore.workers.")]
            for worker in workers if name in loop_readers else []:
                for fn in ast.walk(ast.parse(open(worker.__file__).read())):
                    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        for node in ast.walk(fn):
                            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlcore"):
                                importlib.import_module(node.module)
            files = sorted({m.__file__ for k, m in list(sys.modules.items())
                            if (k == "rlcore" or k.startswith("rlcore.")) and getattr(m, "__file__", None)})
            payload = json.dumps(files)
        except BaseException as err:
            payload = json.dumps({"error": repr(err)})
        with os.fdopen(w, "w") as f:
            f.write(payload)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        result[name] = json.loads(f.read())
    os.waitpid(pid, 0)
print(json.dumps(result))
"""


def reads_agent_loop(stage: dict) -> bool:
    """Whether a dvc.yaml stage's params cover rollout.agent.loop (the whole file, or a section above the key)."""
    params = stage.get("params") or stage.get("do", {}).get("params") or []
    return any(p == {"params.yaml": None} or p in ("rollout", "rollout.agent", "rollout.agent.loop") for p in params)


@pytest.fixture(scope="module")
def loaded_rlcore_files() -> dict[str, list[str]]:
    raw = Config().model_dump(mode="json")  # explicit values, so every validator runs
    scripts = sorted(set(SCRIPTS.values()))
    loop_readers = [SCRIPTS[name] for name in STAGES if reads_agent_loop(dvc_stages()[name])]
    proc = subprocess.run([sys.executable, "-c", MODULES_SCRIPT, ",".join(scripts), json.dumps(raw), "track",
                           ",".join(loop_readers)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, files in result.items():
        assert isinstance(files, list), f"{name}: {files}"
    return {stage: result[script] for stage, script in SCRIPTS.items()}


@pytest.mark.parametrize("name", STAGES)
def test_declared_deps_cover_every_rlcore_module_the_stage_loads(name, loaded_rlcore_files):
    deps = [d for d in entries(dvc_stages()[name].get("deps")) if d.startswith("rlcore/")]
    files = [Path(f).resolve().relative_to(REPO_ROOT) for f in loaded_rlcore_files[name]]
    assert any(str(f) == ("rlcore/inputs.py" if SCRIPTS[name] == "track" else "rlcore/config.py")
               for f in files)  # the check itself saw the stage's modules load
    uncovered = []
    for f in files:
        if str(f) == "rlcore/__init__.py" and not (REPO_ROOT / f).read_text().strip():
            continue  # the empty package marker carries no behaviour
        if not any(str(f) == d or str(f).startswith(d.rstrip("/") + "/") for d in deps):
            uncovered.append(str(f))
    assert not uncovered, f"dvc.yaml stage {name} loads {uncovered} but does not declare them as deps"


@pytest.mark.parametrize("name", STAGES)
def test_every_declared_code_dep_is_code_the_stage_loads(name, loaded_rlcore_files):
    """The other direction: a declared rlcore file (or folder) that the stage never loads would
    re-run the stage for an edit that cannot change it."""
    files = {str(Path(f).resolve().relative_to(REPO_ROOT)) for f in loaded_rlcore_files[name]}
    unused = [d for d in entries(dvc_stages()[name].get("deps")) if d.startswith("rlcore/")
              and not any(f == d or f.startswith(d.rstrip("/") + "/") for f in files)]
    assert not unused, f"dvc.yaml stage {name} declares {unused}, which it does not load"


@pytest.mark.parametrize("name", ["prepare", "sft", "score"])
def test_algorithm_code_is_not_a_dependency_of_data_sft_or_scoring(name, loaded_rlcore_files):
    """Editing the RL algorithms must not throw away the SFT model (an hour on a real model)."""
    algorithm_code = ("rlcore/algos/advantage.py", "rlcore/algos/losses.py", "rlcore/algos/aggregation.py",
                      "rlcore/algos/kl.py", "rlcore/algos/value_loss.py", "rlcore/algos/kl_control.py")
    for d in entries(dvc_stages()[name].get("deps")):
        assert not any(code == d or code.startswith(d.rstrip("/") + "/") for code in algorithm_code), (name, d)
    files = {str(Path(f).resolve().relative_to(REPO_ROOT)) for f in loaded_rlcore_files[name]}
    assert not files & set(algorithm_code)


def test_changing_the_algorithm_does_not_rerun_data_sft_or_scoring():
    stages = dvc_stages()
    for name in ("prepare", "sft", "score"):
        declared = stages[name]["params"]
        assert "algorithm" not in declared and {"params.yaml": None} not in declared, name
    assert "algorithm" in stages["ppo"]["params"]


def test_a_stage_cannot_read_a_section_it_does_not_declare():
    view = DeclaredConfig(Config(), ("seed", "task"), "prepare")
    assert view.seed == 42 and view.task == Config().task
    with pytest.raises(AttributeError, match="prepare.*'algorithm'.*declared: seed, task"):
        view.algorithm
