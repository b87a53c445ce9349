"""The real pipeline, end to end, at tiny size: `dvc repro` in a scratch copy of the repo.

Checks what a user would notice: every declared output appears, a second `dvc repro`
does nothing, switching the estimator makes only the PPO rounds and evaluate stale, MLflow
holds the evaluate run with every param next to its metrics, `rlcore generate` + `rlcore eval`
reproduce the evaluate stage, and the first round run again asynchronously with max_staleness 0,
SIGKILLed after a step checkpoint, resumes and ends exactly as the uninterrupted synchronous one. `rlcore compare` and
`dvc exp run` in the MLflow UI: tests/test_e2e_experiments.py. Both files start from copies of one first
`dvc repro` per test session (:func:`first_repro`).
"""

from __future__ import annotations

import csv
import fcntl
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import yaml

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]

TINY = {
    "task": {"n_sft": 64, "n_rl": 32, "n_test": 16},
    "sft": {"steps": 4, "batch_size": 16, "warmup_steps": 1},
    "score": {"n": 4, "filter_trivial": False},
    "rollout": {"n": 4},
    "ppo": {"train_batch_size": 4, "rounds": {"r1": {"init": "models/sft", "steps": 2},
                                              "r2": {"init": "models/ppo/r1", "steps": 1}},
            "val_every": 1},
    "actor": {"ppo_mini_batch_size": 2},
    "evaluate": {"final_round": "r2", "k": 2, "n_samples": 2, "table_rows": 4},
    "model": {"tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}},
    # a reward function of the user's, at weight 0 (so every number stays the rule's): its file is a dependency of
    # score, the rounds and evaluate only
    "reward": {"functions": [{"path": "rewards/brevity.py", "name": "brevity", "weight": 0.0}]},
    # the stages join the session's Ray head (tests/conftest.py's ray_head, through RAY_ADDRESS) instead of each
    # starting and stopping a private instance of its own: about 10 s less a stage (`rlcore` commands run as
    # processes elsewhere in the suite start private instances, the default's way)
    "ray": {"address": "auto"},
    # one rank per worker group: this file checks the pipeline's mechanics (DVC, MLflow, resume); the two-rank
    # default's data-parallel numerics are test_data_parallel's and its resumes test_resume's and test_ray_cluster's.
    # Each rank is a process that spends ~6 CPU-s importing and loading before its first call: ~70 CPU-s less here
    "resources": {"n_workers": 1},
}
BREVITY = """def brevity(data_source, solution_str, ground_truth, extra_info):
    return {"score": 1.0 / (1 + len(solution_str)), "chars": len(solution_str)}
"""


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(base.get(k, {}), v) if isinstance(v, dict) and k != "rounds" else v
    return out


def run(cmd: list[str], cwd: Path, env: dict) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def ran_stages(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")}


def make_workdir(root: Path) -> dict:
    """A scratch copy of the repository's pipeline in ``root`` (its code, the tiny params, a reward file; git and
    DVC initialised); the environment its commands run in."""
    root.mkdir(parents=True, exist_ok=True)
    for name in ("rlcore", "stages", "inputs", "dvc.yaml", ".dvcignore"):  # (its __pycache__ folders come along)
        src = REPO / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, root / name)
    params = merge(yaml.safe_load((REPO / "params.yaml").read_text()), TINY)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "rewards").mkdir()
    (root / "rewards" / "brevity.py").write_text(BREVITY)
    env = env_of(root)
    run(["git", "init", "-q"], root, env)
    run(["dvc", "init", "-q"], root, env)
    return env


def env_of(root: Path) -> dict:
    # DVC_NO_ANALYTICS: as the repository's .dvc/config says (core.analytics: false), which `dvc init` here does not
    # copy; otherwise every dvc command of the scratch pipelines spawns a process that posts a usage report (~0.8 CPU-s
    # each, ~25 of them in a run of the suite, and a network call these machines refuse)
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "PYTHONPATH": str(root), "RLCORE_CACHE": str(root / ".cache"), "RAY_ADDRESS": "", "DVC_NO_ANALYTICS": "1"}


def first_repro(tmp_path_factory, ray_env: dict) -> tuple[Path, str]:
    """The first `dvc repro` of the tiny pipeline, run once per test session (its folder and its output), its stages
    joining the Ray head ``ray_env`` points at: the two end-to-end files start from copies of it. Under pytest-xdist
    the workers share it through a folder of the session's run (the first worker to get here runs it, on its own
    head; the other waits on the lock and finds it done)."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    base = tmp_path_factory.getbasetemp()
    shared = base.parent / f"e2e-first-repro-{run_id}" if run_id else base / "e2e-first-repro"
    shared.mkdir(exist_ok=True)
    root, output, failed = shared / "repo", shared / "output.txt", shared / "failed.txt"
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a worker dies holding it
        if failed.exists():  # once is enough: the other file fails at once, with the first error
            pytest.fail(f"the session's first dvc repro failed:\n{failed.read_text()}")
        if not output.exists():
            if root.exists():  # a worker that died half way through it (its stages were killed with it)
                shutil.rmtree(root)
            try:
                text = run_group(["dvc", "repro"], root, {**make_workdir(root), **ray_env}, timeout_s=900)
            except BaseException as err:
                failed.write_text(str(err))
                raise
            output.with_suffix(".tmp").write_text(text)
            os.replace(output.with_suffix(".tmp"), output)
    return root, output.read_text()


def run_group(cmd: list[str], cwd: Path, env: dict, timeout_s: float) -> str:
    """:func:`run` in a process group of its own, the whole group killed when it runs past ``timeout_s`` (a stage and
    its Ray workers with it, not only ``dvc``)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{out[-6000:]}"
    return out


def copy_workdir(src: Path, dst: Path) -> None:
    """``src`` (a pipeline that ran) as ``dst``, its MLflow store's artifact paths moved along (the only absolute
    paths it holds); DVC finds every stage up to date there (the lock file's hashes; the copies keep their
    modification times)."""
    shutil.copytree(src, dst, symlinks=True)
    with sqlite3.connect(dst / "mlflow.db") as db:
        old, new = str(src), str(dst)
        db.execute("UPDATE experiments SET artifact_location = replace(artifact_location, ?, ?)", (old, new))
        db.execute("UPDATE runs SET artifact_uri = replace(artifact_uri, ?, ?)", (old, new))
    db.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, ray_head) -> tuple[Path, dict]:
    """This file's own copy of the pipeline after its first `dvc repro`, and its commands' environment (its stages
    join this session's Ray head)."""
    src, _ = first_repro(tmp_path_factory, ray_head)
    root = tmp_path_factory.mktemp("pipeline") / "repo"
    copy_workdir(src, root)
    return root, {**env_of(root), **ray_head}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, ray_head) -> str:
    """What the first `dvc repro` printed."""
    return first_repro(tmp_path_factory, ray_head)[1]


def test_repro_writes_every_declared_output(workdir, first_run):
    root, _ = workdir
    assert ran_stages(first_run) == {"check_params", "reward_file@0", "prepare", "sft", "score", "ppo@r1", "ppo@r2",
                                     "evaluate"}
    for model in ("models/sft", "models/ppo/r1", "models/ppo/r2"):
        assert (root / model / "config.json").is_file() and (root / model / "tokenizer.json").is_file()
        assert list((root / model).glob("*.safetensors"))
    ev = json.loads((root / "metrics/eval.json").read_text())
    for name in ("sft", "final"):
        solved = ev[f"{name}/greedy_pass@1"] * 16  # a share of the 16 test prompts
        assert abs(solved - round(solved)) < 1e-9
        assert ev[f"{name}/pass@1"] <= ev[f"{name}/pass@2"] + 1e-9  # pass@k grows with k
    assert ev["gain/greedy_pass@1"] == ev["final/greedy_pass@1"] - ev["sft/greedy_pass@1"]
    assert ev["test/n_prompts"] == 16
    from rlcore.viewer import read_rollouts

    rollouts = read_rollouts(root / "metrics/ppo_r1_rollouts.parquet")  # min(log_samples 8, 16 rollouts) a step
    assert rollouts["step"].tolist() == [0] * 8 + [1] * 8
    assert rollouts["policy_version"].tolist() == [0] * 8 + [1] * 8  # one actor update per step
    steps = (root / "plots/ppo_r1.csv").read_text().splitlines()
    assert len(steps) == 1 + 2 and "rollout/acc" in steps[0]  # header + one row per step
    assert "val/greedy_pass@1" in steps[0]
    plot = pd.read_csv(root / "plots/ppo_r1.csv")
    assert (plot["reward/brevity/mean"] > 0).all() and (plot["reward/brevity/chars"] >= 1).all()
    assert plot["rollout/reward_mean"].tolist() == plot["reward/rule/mean"].tolist()  # brevity's weight is 0
    assert {"final/reward/brevity/mean", "sft/reward/rule/mean"} <= set(ev)


def test_round_validation_agrees_with_evaluate(workdir, first_run):
    """ppo.val_every runs greedy decoding on the test split inside the round: before r1's first
    step it sees the SFT weights, after r2's last step the final weights, so it must agree with
    what the separate evaluate stage measures on the saved models."""
    root, _ = workdir
    ev = json.loads((root / "metrics/eval.json").read_text())
    r1 = json.loads((root / "metrics/ppo_r1.json").read_text())
    r2 = json.loads((root / "metrics/ppo_r2.json").read_text())
    assert r1["ppo/val_greedy_pass@1_first"] == ev["sft/greedy_pass@1"]
    assert r2["ppo/val_greedy_pass@1_last"] == ev["final/greedy_pass@1"]


@pytest.mark.integration
def test_generate_then_eval_reproduces_the_evaluate_stage(workdir, first_run, ray_local, capsys):
    """`rlcore generate` on the test split with the evaluate stage's sampling settings (n_samples,
    temperature, and its seed: seed + 1), then `rlcore eval`: the same pass@1 and pass@k as the stage
    on the same machine and resources, since generation shares the stage's workers and seeding.
    (In this process, on the session's Ray instance with as many CPUs as the stages' own: a Ray start
    fewer than running the command.)"""
    from rlcore.commands import main

    root, _ = workdir
    ev = json.loads((root / "metrics/eval.json").read_text())
    assert main(["generate", "--params", str(root / "params.yaml"), "--model", str(root / "models/ppo/r2"),
                 "--data", str(root / "data/processed/test.parquet"), "--out", str(root / "gen.parquet"),
                 "--n", "2", "--temperature", "1.0", "--seed", "43"]) == 0
    assert main(["eval", "--generations", str(root / "gen.parquet"), "--k", "2",
                 "--out", str(root / "gen_eval.json")]) == 0
    out = capsys.readouterr().out
    res = json.loads((root / "gen_eval.json").read_text())
    assert res["n_prompts"] == 16 and res["by_data_source"]["arithmetic"]["n_prompts"] == 16
    assert res["pass@1"] == pytest.approx(ev["final/pass@1"], abs=1e-12), out
    assert res["pass@k"] == pytest.approx(ev["final/pass@2"], abs=1e-12), out
    import pyarrow.parquet as pq

    rows = pq.read_table(root / "gen.parquet").to_pylist()
    assert all(len(r["responses"]) == 2 and r["reward_model"]["ground_truth"] for r in rows)
    assert any(r["responses"][0] != r["responses"][1] for r in rows)  # sampled, not one draw copied


def sync_rows(path: Path) -> list[dict]:
    """A plot CSV's rows without timings and throughput, the async round's own columns, and the number of DAPO
    sampling tries (always 1 without dynamic sampling, which async rounds refuse: they do not log it)."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/", "async/", "rollout/sample_tries"))}
            for r in csv.DictReader(path.open())]


def killed_at(checkpoint: Path, cmd: list[str], root: Path, env: dict) -> None:
    """Run ``cmd`` in a process group of its own and SIGKILL the whole group (its actors on the session's Ray head
    die with it) as soon as ``checkpoint`` exists."""
    proc = subprocess.Popen(cmd, cwd=root, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not checkpoint.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the round ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# An asynchronous round with max_staleness 0, one generator and none killed: each step trains the batch generated
# with the current weights (a batch generated before the restored weights were published would show here as
# staleness or dropped samples); the other async columns measure time and load.
ASYNC_DETERMINED = {"async/staleness": 0.0, "async/dropped_samples": 0.0, "async/generator_deaths": 0.0,
                    "async/generators": 1.0}
ASYNC_TIMED = {"async/queue_depth", "async/trainer_idle_frac", "async/generator_idle_frac", "async/generation_s"}


@pytest.mark.integration
def test_an_async_round_killed_after_a_checkpoint_resumes_and_ends_as_the_sync_round(workdir, first_run):
    """ppo@r1 again, as an asynchronous round (a generator worker beside the trainer's rank, a queue,
    versioned weights) with max_staleness 0, checkpointing after each step, SIGKILLed (its whole process group; its
    actors on the session's Ray head die with it) as soon as the step-1 checkpoint exists; a module the stage does
    not run (the `rlcore serve` command's) is edited, and the same command again says it resumes and ends with
    exactly the synchronous first run's plot rows, rollouts, metrics and weights (timings aside). The batch handed out before
    the kill is generated again with the restored weights: no step of the resumed round is stale or drops a batch.
    Outputs go to other paths, so DVC's state is untouched."""
    root, env = workdir
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["ppo"].update(save_every=1, mode="async", **{"async": {"max_staleness": 0, "queue_size": 1}})
    params["rollout"].update(n_workers=1, cpus_per_worker=1)
    (root / "params_ckpt.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    cmd = [sys.executable, "-m", "stages.ppo", "--params", "params_ckpt.yaml", "--round", "r1", "--init", "models/sft",
           "--data", "data/scored/rl_train.parquet", "--rewards", "inputs/reward", "--out", "models/resumed_r1", "--metrics", "metrics/resumed.json",
           "--plots", "plots/resumed.csv", "--val-data", "data/processed/test.parquet",
           "--rollouts", "metrics/resumed_rollouts.parquet"]
    checkpoint = root / "checkpoints" / "ppo@r1" / "step_00000001"
    killed_at(checkpoint, cmd, root, env)
    assert not (root / "models/resumed_r1/model.safetensors").exists()

    unrelated = root / "rlcore/commands/serve.py"  # the stage's checkpoints depend on its own code only
    original = unrelated.read_text()
    unrelated.write_text(original + "\n# edited after the crash\n")
    try:
        out = run(cmd, root, env)
    finally:
        unrelated.write_text(original)
    assert f"resuming ppo@r1 from step 1 ({checkpoint})" in out and "not resuming" not in out
    assert "ppo async: 1 generator(s)" in out
    assert not (root / "checkpoints" / "ppo@r1").exists()  # removed once the round succeeded (keep_last 0)

    resumed = list(csv.DictReader((root / "plots/resumed.csv").open()))
    # the async columns: those an uninterrupted round at max_staleness 0 determines are what it logs on every row,
    # the steps before the kill (restored) and after it; the others measure time and load
    async_columns = {k for k in resumed[0] if k.startswith("async/")}
    assert async_columns == set(ASYNC_DETERMINED) | ASYNC_TIMED, async_columns
    for column, value in ASYNC_DETERMINED.items():
        assert [float(r[column]) for r in resumed] == [value] * len(resumed), column
    assert sync_rows(root / "plots/resumed.csv") == sync_rows(root / "plots/ppo_r1.csv")
    pd.testing.assert_frame_equal(pd.read_parquet(root / "metrics/resumed_rollouts.parquet"),
                                  pd.read_parquet(root / "metrics/ppo_r1_rollouts.parquet"))
    assert (root / "models/resumed_r1/model.safetensors").read_bytes() == \
        (root / "models/ppo/r1/model.safetensors").read_bytes()
    sync_m, async_m = (json.loads((root / f"metrics/{n}.json").read_text()) for n in ("ppo_r1", "resumed"))
    assert {k: v for k, v in async_m.items() if k != "ppo/wall_s"} == \
        {k: v for k, v in sync_m.items() if k != "ppo/wall_s"}

    # the re-run continued the killed run's MLflow run: one more r1 run in all, finished, every step in it
    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["rlcore"], filter_string="tags.`rlcore.round` = 'r1'")
    assert len(runs) == 2 and set(runs["status"]) == {"FINISHED"}
    client = mlflow.MlflowClient()
    for run_id in runs["run_id"]:
        assert sorted({m.step for m in client.get_metric_history(run_id, "rollout/acc")}) == [0, 1]


def determined_rows(path: Path) -> list[dict]:
    """A plot CSV's rows without timings, throughput and the async columns that measure time and load."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/", *ASYNC_TIMED))}
            for r in csv.DictReader(path.open())]


@pytest.mark.integration
def test_an_async_round_on_the_fixed_schedule_is_the_same_on_every_run_and_after_a_kill(workdir, first_run):
    """ppo@r1 again, asynchronous with max_staleness 1 on the fixed schedule (batch k generated by version
    max(0, k - 1)), three steps checkpointed after each, twice: once to the end, once SIGKILLed as soon as its step-1
    checkpoint exists and then run again, which resumes. Both end with the same plot rows (the async columns that
    count versions and drops included), rollouts, metrics and weights, timings aside: the batch generated for
    version 0 before the kill, which the resumed round (at version 1) cannot make again, was kept in the checkpoint,
    neither lost nor trained twice."""
    root, env = workdir
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["ppo"].update(save_every=1, mode="async", **{"async": {"max_staleness": 1, "queue_size": 1,
                                                                  "schedule": "fixed"}})
    params["ppo"]["rounds"]["r1"]["steps"] = 3
    params["actor"]["off_policy"]["correction"] = "tis"
    params["rollout"].update(n_workers=1, cpus_per_worker=1)
    (root / "params_fixed.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    def cmd(name: str) -> list[str]:
        return [sys.executable, "-m", "stages.ppo", "--params", "params_fixed.yaml", "--round", "r1", "--init",
                "models/sft", "--data", "data/scored/rl_train.parquet", "--rewards", "inputs/reward", "--out",
                f"models/{name}", "--metrics", f"metrics/{name}.json", "--plots", f"plots/{name}.csv", "--val-data",
                "data/processed/test.parquet", "--rollouts", f"metrics/{name}_rollouts.parquet"]

    run(cmd("fixed_whole"), root, env)
    checkpoint = root / "checkpoints" / "ppo@r1" / "step_00000001"
    killed_at(checkpoint, cmd("fixed_resumed"), root, env)
    out = run(cmd("fixed_resumed"), root, env)
    assert f"resuming ppo@r1 from step 1 ({checkpoint})" in out

    whole, resumed = (determined_rows(root / f"plots/{n}.csv") for n in ("fixed_whole", "fixed_resumed"))
    assert [float(r["async/staleness"]) for r in whole] == [0.0, 1.0, 1.0]
    assert all(float(r["async/dropped_samples"]) == 0.0 for r in whole)
    assert resumed == whole
    pd.testing.assert_frame_equal(pd.read_parquet(root / "metrics/fixed_resumed_rollouts.parquet"),
                                  pd.read_parquet(root / "metrics/fixed_whole_rollouts.parquet"))
    assert (root / "models/fixed_resumed/model.safetensors").read_bytes() == \
        (root / "models/fixed_whole/model.safetensors").read_bytes()
    whole_m, resumed_m = (json.loads((root / f"metrics/{n}.json").read_text()) for n in ("fixed_whole",
                                                                                          "fixed_resumed"))
    assert {k: v for k, v in resumed_m.items() if k != "ppo/wall_s"} == \
        {k: v for k, v in whole_m.items() if k != "ppo/wall_s"}


def test_second_repro_does_nothing(workdir, first_run):
    root, env = workdir
    assert ran_stages(run(["dvc", "repro"], root, env)) == set()


def stale_stages(root: Path, env: dict) -> set[str]:
    status = run(["dvc", "status"], root, env)
    # one "<stage>:" line per stale stage (then its changes, indented); "Data and pipelines are up to date." if none
    return {line[:-1] for line in status.splitlines() if line.endswith(":") and not line[0].isspace()}


def test_estimator_switch_makes_only_ppo_and_evaluate_stale(workdir, first_run):
    """An estimator switch makes the rounds and evaluate stale, an evaluation setting evaluate alone, a limit of
    the tool loop the stages that generate (SFT reads only the loop and its tools' schemas). `dvc repro`
    re-runs exactly the stages `dvc status` lists (checked once, by the first run and the
    second repro above); re-running them here would cost three stage start-ups for no new check."""
    root, env = workdir
    original = (root / "params.yaml").read_text()
    params = yaml.safe_load(original)
    params["algorithm"]["adv_estimator"] = "rloo"
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    try:
        # (check_params reads the whole file; its output does not change, so it re-runs no other stage)
        assert stale_stages(root, env) == {"check_params", "ppo@r1", "ppo@r2", "evaluate"}
        params["algorithm"]["adv_estimator"] = yaml.safe_load(original)["algorithm"]["adv_estimator"]
        params["evaluate"]["temperature"] = 0.7  # an evaluation setting: only evaluate
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        assert stale_stages(root, env) == {"check_params", "evaluate"}
        params["evaluate"]["temperature"] = yaml.safe_load(original)["evaluate"]["temperature"]
        params["rollout"]["agent"]["timeout_s"] = 3.0  # a limit of the tool loop: not SFT's (it reads loop, tools)
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        assert stale_stages(root, env) == {"check_params", "score", "ppo@r1", "ppo@r2", "evaluate"}
    finally:
        (root / "params.yaml").write_text(original)

    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["rlcore"], filter_string="tags.`rlcore.stage` = 'evaluate'")
    assert list(runs["params.algorithm.adv_estimator"]) == ["grpo"]  # every params key, next to the metrics
    assert runs["metrics.final/greedy_pass_at_1"].notna().all()
    ppo_runs = mlflow.search_runs(experiment_names=["rlcore"], filter_string="tags.`rlcore.stage` = 'ppo'")
    assert set(ppo_runs["tags.rlcore.round"]) == {"r1", "r2"}


def test_editing_a_reward_file_reruns_exactly_the_stages_that_score(workdir, first_run):
    """The reward file's own stage is stale; once it has run (a real `dvc repro` of it), score, the rounds and
    evaluate are, while prepare and sft stay cached. The file's sha256 is a param of the runs that used it."""
    root, env = workdir
    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["rlcore"], filter_string="tags.`rlcore.stage` = 'evaluate'")
    from rlcore.inputs import sha256_of

    assert list(runs["params.reward_inputs.brevity.sha256"]) == [sha256_of(root / "rewards" / "brevity.py")]
    original = (root / "rewards" / "brevity.py").read_text()
    (root / "rewards" / "brevity.py").write_text(original + "# tuned\n")
    try:
        assert stale_stages(root, env) == {"reward_file@0"}
        assert ran_stages(run(["dvc", "repro", "reward_file@0"], root, env)) == {"reward_file@0"}
        assert stale_stages(root, env) == {"score", "ppo@r1", "ppo@r2", "evaluate"}
    finally:
        (root / "rewards" / "brevity.py").write_text(original)
        run(["dvc", "repro", "reward_file@0"], root, env)
    assert stale_stages(root, env) == set()


def test_editing_algorithm_code_leaves_data_sft_and_scoring_up_to_date(workdir, first_run):
    """A comment appended to the advantage estimators and the losses changes neither the data, the
    SFT model nor the scores: `dvc status` must report only the PPO rounds (which run that code)."""
    root, env = workdir
    assert stale_stages(root, env) == set()  # up to date (the estimator switch above was undone)
    for code in ("rlcore/algos/advantage.py", "rlcore/algos/losses.py"):
        with open(root / code, "a") as f:
            f.write("# an edit that changes no behaviour\n")
    assert stale_stages(root, env) == {"ppo@r1", "ppo@r2"}
