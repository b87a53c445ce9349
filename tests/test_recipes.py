"""Every recipe in examples/ through DVC itself, with the commands the README gives for it.

A recipe is a whole params file (every key, the ones it changes marked): `cp examples/<recipe>.yaml params.yaml`
and `dvc repro` runs it. Here, in one scratch copy of the repository, one recipe after another, as a user who
tries them in turn:

* at the recipe's own sizes, the file copied over params.yaml: DVC builds the pipeline the recipe asks for (every
  stage, the foreach stages of its task files, reward functions, tools, reward models and rounds included), from
  params.yaml as DVC reads it;
* at smoke-test sizes (the recipe copied over params.yaml, then `rlcore config use params.yaml examples/quick.yaml`,
  as the examples page says), `dvc repro` runs every stage to the end and the outputs a user would look at are
  there. These runs (marker ``recipes``) take about 16 minutes of a 2-core machine for the 14 recipes, more than
  the whole of `make test`'s budget: `make test-integration` runs them with the suite's other long runs (`make
  test-recipes` alone), and CI runs it after `make test` (.ci/run).

DVC re-runs only the stages a recipe's params change, and restores from its run cache a stage an earlier recipe
ran with the same code, inputs and params. The stages join the session's Ray head (``--set ray.address=auto``) with
one rank per worker group: each stage would otherwise start and stop a private Ray instance, and each rank is a
process that imports torch and loads a model before its first call.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.test_e2e_pipeline import env_of, ran_stages, run, run_group

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
# the default recipe first: the data, SFT and scoring it runs are most of the other recipes' too
RECIPES = sorted((p.stem for p in (REPO / "examples").glob("*.yaml") if p.stem != "quick"), key=lambda n: n != "grpo")
# the resources of this suite, not of the recipes: the session's Ray head, one rank per group of half a CPU (as
# examples/async.yaml needs on the 2-CPU head, so that its SFT and scoring are the others' too), no MLflow (each
# stage would import it and write its runs: tests/test_e2e_pipeline.py checks the tracking)
SUITE = ["--set", "ray.address=auto", "--set", "resources.n_workers=1", "--set", "resources.cpus_per_worker=0.5",
         "--set", "tracking.enabled=false"]


def expected_stages(cfg) -> set[str]:
    """The stages dvc.yaml makes of a config, worked out from the config alone."""
    stages = {"check_params", "prepare", "sft", "score", "evaluate"}
    stages |= {f"ppo@{r}" for r in cfg.ppo.rounds} | {f"rm@{m}" for m in cfg.rm.models}
    stages |= {f"task_file@{k}" for k in cfg.task.file}
    stages |= {f"reward_file@{i}" for i in range(len(cfg.reward.functions))}
    stages |= {f"tool_file@{i}" for i in range(len(cfg.rollout.agent.tools))}
    stages |= {f"agent_file@{i}" for i in range(len(cfg.rollout.agent.agents))}
    return stages


def scratch_copy(root: Path) -> dict:
    """The repository's pipeline in ``root`` (code, inputs, examples, dvc.yaml; git and DVC initialised); the
    environment its commands run in."""
    root.mkdir(parents=True)
    for name in ("rlcore", "stages", "inputs", "examples", "dvc.yaml", ".dvcignore"):
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, root / name)
    env = env_of(root)
    run(["git", "init", "-q"], root, env)
    run(["dvc", "init", "-q"], root, env)
    return env


def rlcore(args: list[str], root: Path, env: dict) -> str:
    return run([str(Path(sys.executable).parent / "rlcore"), *args], root, env)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("recipes") / "repo"
    return root, scratch_copy(root)


def test_every_recipe_copied_over_params_yaml_gives_dvc_the_pipeline_it_asks_for(repo, monkeypatch):
    """Each recipe at its own size copied over params.yaml, then the pipeline as DVC parses it from that file
    (DVC's own index: every stage, the foreach stages expanded), every key a stage lists found in the file, and
    what `dvc repro --dry -f` would run, in DVC's order. (``-f``: without it, DVC 3's dry run looks in its run
    cache for a stage whose inputs an earlier stage has not made yet and stops: treeverse/dvc#9818.)"""
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo

    from rlcore.config import load_config

    root, _ = repo
    monkeypatch.chdir(root)  # DVC's planner finds the stages by paths relative to the working directory
    for name in [*RECIPES, "quick"]:
        shutil.copy(root / "examples" / f"{name}.yaml", root / "params.yaml")
        cfg = load_config(root / "params.yaml")
        with Repo(str(root)) as dvc:
            stages = {s.name: s for s in dvc.index.stages}
            assert set(stages) == expected_stages(cfg), name
            for stage in stages.values():
                for dep in (d for d in stage.deps if isinstance(d, ParamsDependency)):
                    assert set(dep.params) <= set(dep.read_params()), (name, stage.name)
            planned = [s.name for s in dvc.reproduce(dry=True, force=True)]
        assert set(planned) == set(stages), name
        assert planned.index("sft") < planned.index("score") < planned.index("evaluate"), name


# what each recipe's run must show beyond the common outputs (the metrics file and a key in it, or a path)
SHOWS = {
    "async": ("plots/ppo_r1.csv", "async/staleness"),
    "calculator": ("metrics/ppo_r1.json", "ppo/agent/error_observations_last10"),
    "calculator-openai": ("metrics/ppo_r1.json", "ppo/agent/failures_last10"),
    "dapo": ("plots/ppo_r1.csv", "rollout/sample_tries"),
    "distill": ("plots/ppo_r1.csv", "distill/reverse_kl"),
    "lora": ("models/ppo/r1/adapter_config.json", None),
    "own-reward": ("metrics/eval.json", "final/reward/reversal/mean"),
    "ppo-critic": ("models/ppo/r1/critic/config.json", None),
    "reinforce-pp": ("plots/ppo_r1.csv", "actor/reward_kl_penalty"),
    "rlhf": ("metrics/rm_arith.json", "rm/test_accuracy"),
    "vllm": ("metrics/ppo_r1.json", "ppo/reward_last10"),
}


# a recipe that needs an optional install runs where it is installed (examples/vllm.yaml: make test-vllm, CI)
NEEDS = {"vllm": "vllm"}
# what a recipe's header says to do before its dvc repro: examples/distill.yaml's teacher, another pipeline's trained
# policy copied aside: here the round's model of the recipe run before it, or that recipe's SFT model where its round
# wrote a LoRA adapter (the suite orders the recipes by their run time, so which ran before is not fixed)
BEFORE = {"distill": (("models/ppo/r1", "models/sft"), "models/teacher")}


@pytest.mark.recipes
@pytest.mark.parametrize("name", [pytest.param(n, marks=[getattr(pytest.mark, NEEDS[n]), pytest.mark.skipif(
    importlib.util.find_spec(NEEDS[n]) is None, reason=f"{NEEDS[n]} is not installed")]) if n in NEEDS else n
    for n in RECIPES])
def test_every_recipe_runs_to_the_end_at_smoke_test_sizes(repo, ray_head, name):
    from rlcore.config import load_config

    root, env = repo
    env = {**env, **ray_head}
    shutil.copy(root / "examples" / f"{name}.yaml", root / "params.yaml")
    rlcore(["config", "use", "params.yaml", "examples/quick.yaml", *SUITE], root, env)
    if name in BEFORE:
        sources, dest = BEFORE[name]
        src = next((s for s in sources if (root / s / "config.json").is_file()), None)
        assert src is not None, f"{name} needs a model folder another recipe wrote first: one of {sources}"
        shutil.rmtree(root / dest, ignore_errors=True)
        shutil.copytree(root / src, root / dest)
    out = run_group(["dvc", "repro"], root, env, timeout_s=600)
    cfg = load_config(root / "params.yaml")
    assert ran_stages(out) <= expected_stages(cfg)
    ev = json.loads((root / "metrics/eval.json").read_text())
    assert 0.0 <= ev["final/greedy_pass@1"] <= 1.0 and ev["test/n_prompts"] == cfg.task.n_test
    final = root / "models/ppo/r1"  # a model folder, or with LoRA an adapter folder over the SFT model
    assert (final / "config.json").is_file() or (final / "adapter_config.json").is_file()
    if name in SHOWS:
        path, key = SHOWS[name]
        assert (root / path).is_file(), path
        if key is not None and path.endswith(".json"):
            assert key in json.loads((root / path).read_text()), key
        elif key is not None:
            assert key in pd.read_csv(root / path).columns, key
