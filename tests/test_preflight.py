"""`rlcore config check` refuses what a stage or `dvc repro` would refuse with the same params, and `dvc repro`
stops on bad params before it deletes any stage's outputs.

* each input a newcomer tried (a params.yaml of one key, a model folder that is not there or not a model, a quoted
  number, a misspelt key, a task column that is not in the file, a round that starts from nothing) is one line
  and exit code 2, naming the key; an unquoted ``1e-5`` is a number, as DVC reads it;
* the verdict on a params.yaml beside the repository's dvc.yaml is DVC's own: DVC's index of the pipeline (what
  `dvc repro` builds first) fails, or a stage lists a key the file lacks, exactly when `config check` refuses;
* `dvc repro prepare` with a misspelt key stops at the check_params stage, naming the key and its right spelling,
  and the committed metrics/prepare.json is still there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlcore.commands import main
from tests.conftest import REPO_ROOT

REVERSE = REPO_ROOT / "examples" / "reverse"


def check(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(["config", "check", *argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def pipeline(tmp_path, monkeypatch) -> Path:
    """A folder holding the repository's dvc.yaml (and the example task files), as the working directory."""
    shutil.copy(REPO_ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    shutil.copytree(REVERSE, tmp_path / "examples" / "reverse")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_params_yaml_of_one_key_is_refused_naming_the_keys_dvc_reads(pipeline, capsys):
    (pipeline / "params.yaml").write_text("actor: {lr: 3.0e-5}\n")
    code, _, err = check([], capsys)
    assert code == 2 and err.count("\n") == 1, err
    # the first four in dvc.yaml's order (the input files' stages come first), then how many more
    assert "task.file (stage task_file)" in err and "rollout.agent.agents (stage agent_file) and " in err
    assert "rlcore config use params.yaml" in err
    # the repair it names works: every key written, the file's own value kept
    assert main(["config", "use", "params.yaml"]) == 0
    assert yaml.safe_load((pipeline / "params.yaml").read_text())["actor"]["lr"] == 3.0e-5
    code, out, _ = check([], capsys)
    assert code == 0 and "dvc.yaml: the 28 keys it reads are in the file" in out, out


def test_a_recipe_of_a_few_keys_passes_with_a_note_and_no_params_yaml_beside_dvc_yaml_is_refused(pipeline, capsys):
    (pipeline / "mine.yaml").write_text("actor: {lr: 3.0e-5}\n")
    code, out, _ = check(["--params", "mine.yaml"], capsys)
    assert code == 0 and "note: mine.yaml is not params.yaml" in out and "rlcore config use mine.yaml" in out
    code, _, err = check([], capsys)
    assert code == 2 and "no params.yaml here, beside dvc.yaml" in err


@pytest.mark.parametrize("setting, words", [
    ("model.path=models/nope", ["model.path 'models/nope': no such folder"]),
    ("model.path=empty", ["model.path 'empty':", "lacks config.json"]),
    ("ppo.rounds.r1.init=models/sfft", ["ppo.rounds.r1.init 'models/sfft'", "no earlier stage", "(models/sft)"]),
    ("distill.teacher=models/teacher", ["distill.teacher 'models/teacher'", "no earlier stage", "(models/sft)"]),
    ('ppo.train_batch_size="32"', ["ppo.train_batch_size = '32'", "write it without quotes"]),
    ("tracking.enabled=1", ["tracking.enabled = 1", "valid boolean"]),
    ("algorithm.adv_estimater=rloo", ["unknown key 'algorithm.adv_estimater'; did you mean algorithm.adv_estimator?"]),
    ("ppo.rounds.r1.step=3", ["unknown key 'ppo.rounds.r1.step'; did you mean ppo.rounds.r1.steps?"]),
])
def test_each_mistyped_input_is_one_line_naming_the_key(pipeline, capsys, setting, words):
    shutil.copy(REPO_ROOT / "params.yaml", pipeline / "params.yaml")
    (pipeline / "empty").mkdir()
    code, _, err = check(["--set", setting], capsys)
    assert code == 2 and err.count("\n") == 1, err
    for w in words:
        assert w in err, err


def test_a_task_column_the_file_lacks_names_the_key_and_the_files_columns(pipeline, capsys):
    shutil.copy(REPO_ROOT / "params.yaml", pipeline / "params.yaml")
    files = ["--set", "task.name=file", "--set", "task.file.train=examples/reverse/train.jsonl",
             "--set", "task.file.test=examples/reverse/test.jsonl"]
    code, _, err = check([*files, "--set", "task.columns.ground_truth=gt"], capsys)
    first = json.loads((REVERSE / "train.jsonl").read_text().splitlines()[0])
    assert code == 2 and "no column 'gt', which task.columns.ground_truth names" in err, err
    assert "the file's columns: " + ", ".join(repr(k) for k in first) in err
    code, out, _ = check([*files, "--set", "task.columns.ground_truth=answer"], capsys)
    assert code == 0 and "task.file.train: examples/reverse/train.jsonl: readable, first row ok" in out


def test_an_unquoted_exponent_is_a_number_as_dvc_reads_it(pipeline, capsys):
    from rlcore.config import load_config

    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    (pipeline / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False).replace(
        "  lr: 0.0001\n", "  lr: 1e-5\n", 1))
    assert "lr: 1e-5" in (pipeline / "params.yaml").read_text()
    assert load_config("params.yaml").actor.lr == 1e-5
    assert check([], capsys)[0] == 0
    assert check(["--set", "actor.lr=2e-5"], capsys)[0] == 0


# DVC's own verdict on the params.yaml of each folder given: its index of the pipeline fails to build, or a stage lists
# a params key the file lacks (`dvc repro` stops at that stage: 'Parameters ... are missing'). In a process of its own:
# DVC's logging, set up in the test process, would outlive the test's captured streams.
DVC_VERDICT = """
import json, sys
from dvc.dependency.param import ParamsDependency
from dvc.repo import Repo

def refuses(root):
    try:
        with Repo(root) as repo:
            return any(not set(dep.params) <= set(dep.read_params()) for stage in repo.index.stages
                       for dep in stage.deps if isinstance(dep, ParamsDependency))
    except Exception:  # any of DVC's parse errors is a refusal
        return True

print(json.dumps({root: refuses(root) for root in sys.argv[1:]}))
"""


def test_config_check_refuses_exactly_what_dvc_refuses(pipeline, capsys):
    full = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    cases = {"the repository's": full, "one key": {"actor": {"lr": 3.0e-5}},
             "no seed": {k: v for k, v in full.items() if k != "seed"},
             "no rounds": {**full, "ppo": {k: v for k, v in full["ppo"].items() if k != "rounds"}},
             "no evaluate": {k: v for k, v in full.items() if k != "evaluate"}}
    env = {"PATH": str(Path(sys.executable).parent), "DVC_NO_ANALYTICS": "1", "HOME": str(pipeline)}
    ours = {}
    for i, (name, params) in enumerate(cases.items()):
        folder = pipeline / f"case{i}"
        folder.mkdir()
        shutil.copy(pipeline / "dvc.yaml", folder / "dvc.yaml")
        (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        subprocess.run([str(Path(sys.executable).parent / "dvc"), "init", "-q", "--no-scm"], cwd=folder, check=True,
                       env=env)
        ours[name] = check(["--params", str(folder / "params.yaml")], capsys)[0] == 2
    proc = subprocess.run([sys.executable, "-c", DVC_VERDICT, *(str(pipeline / f"case{i}") for i in range(len(cases)))],
                          capture_output=True, text=True, timeout=300, env=env, check=True)
    dvc = dict(zip(cases, json.loads(proc.stdout.strip().splitlines()[-1]).values()))
    assert ours == dvc == {"the repository's": False, "one key": True, "no seed": True, "no rounds": True,
                           "no evaluate": True}


def test_dvc_repro_stops_on_a_misspelt_key_before_deleting_the_committed_metrics(tmp_path):
    """check_params is upstream of every stage that reads params.yaml: DVC runs it first, it fails, and prepare (whose
    outputs DVC would delete before running it) never starts."""
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("rlcore", "stages", "inputs", "dvc.yaml", ".dvcignore", "metrics"):
        src = REPO_ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, root / name)
    params = (REPO_ROOT / "params.yaml").read_text()
    assert "\n  max_digits: 2\n" in params
    (root / "params.yaml").write_text(params.replace("\n  max_digits: 2\n", "\n  max_digit: 2\n"))
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(root), "DVC_NO_ANALYTICS": "1",
           "HOME": str(tmp_path)}
    dvc = str(Path(sys.executable).parent / "dvc")
    subprocess.run([dvc, "init", "-q", "--no-scm"], cwd=root, check=True, env=env)
    committed = (REPO_ROOT / "metrics" / "prepare.json").read_text()
    proc = subprocess.run([dvc, "repro", "prepare"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "check_params: error: params.yaml: unknown key 'task.max_digit'; did you mean task.max_digits" \
        in proc.stderr, proc.stdout + proc.stderr
    assert "Running stage 'prepare'" not in proc.stdout
    assert (root / "metrics" / "prepare.json").read_text() == committed
