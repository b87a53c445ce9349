"""`rlcore diagnose` and rlcore.diagnose: the version-range rules on crafted versions, the disk and
resource thresholds on crafted numbers, and failures made on purpose (an MLflow store under a file, a
model folder without config.json, a Ray address nobody listens on, a folder that is not a DVC repo,
a check that hangs) each reported as fail with exit code 1. Nothing starts Ray or imports torch:
the CLI tests run in a temporary folder with the built-in defaults and skip the checks they do not
aim at.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement

from rlcore import diagnose
from rlcore.commands import main
from rlcore.config import Config, parse_config
from rlcore.diagnose import (
    base,
    disk,
    dvc_check,
    mlflow_check,
    model,
    packages,
    python,
    ray_check,
    requirements,
    torch_check,
)
from rlcore.diagnose.base import Check, Context
from rlcore.diagnose.packages import requirement_check

# the checks that start Ray, import torch or run dvc status: left out unless a test aims at them
SLOW = "ray,torch,dvc"
GIB = 2**30


def diagnose_cli(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main(["diagnose", *argv])
    return code, capsys.readouterr().out.splitlines()


def lines_of(out: list[str], status: str) -> list[str]:
    return [line for line in out if line.startswith(f"{status} ")]


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """Run in an empty folder: no params.yaml (built-in defaults), no DVC repo, no pyproject.toml."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- version ranges ----------------------------------------------------------------------------


@pytest.mark.parametrize("requirement, installed, status", [
    ("ray[default]>=2.50,<3", "2.60.0", "ok"),
    ("torch==2.13.0", "2.13.0+cpu", "ok"),             # a local label matches a plain pin (PEP 440)
    ("mlflow>=3.10,<4", "3.10.0rc1", "fail"),          # a pre-release of the lower bound is older than it
    ("ray[default]>=2.50,<3", "2.49.9", "fail"),       # older than the lower bound
    ("torch==2.13.0", "2.12.1", "fail"),               # off the pin
    ("torch==2.13.0", "2.14.0", "fail"),
    ("ray[default]>=2.50,<3", "3.0.0", "warn"),        # only the upper bound missed: newer than tested
    ("pandas>=2.2,<4", "4.1", "warn"),
    ("pydantic!=2.8.0,<3", "2.8.0", "fail"),           # an excluded version
    ("safetensors>=0.5", None, "fail"),                # not installed
    ("tqdm>=4.66", "not-a-version", "fail"),
])
def test_requirement_check_classifies_versions(requirement, installed, status):
    check = requirement_check(requirement, installed)
    assert check.status == status, check
    name = Requirement(requirement).name
    assert check.name == name
    if status != "ok":  # the fix installs the declared range, extras included
        assert f"pip install '{requirement.split('>')[0].split('=')[0].split('!')[0]}" in check.fix


def test_requirement_check_missing_package_names_the_range_and_keeps_extras():
    check = requirement_check("ray[default]>=2.50,<3", None)
    assert check.detail == "ray is not installed (needs <3,>=2.50)"
    assert check.fix == "pip install 'ray[default]<3,>=2.50'"


def test_another_torch_on_a_gpu_build_is_a_warning_not_a_failure():
    assert requirement_check("torch==2.13.0", "2.9.1+cu128").status == "fail"
    gpu = packages.torch_is_gpu_build("2.9.1+cu128", [])
    assert gpu
    check = requirement_check("torch==2.13.0", "2.9.1+cu128", other_version_ok=gpu)
    assert check.status == "warn" and "GPU" in check.detail


@pytest.mark.parametrize("version, requires, gpu", [
    ("2.13.0+cpu", ["filelock", "sympy>=1.13.3"], False),
    ("2.9.1+cu128", None, True),
    ("2.8.0+rocm6.3", None, True),
    ("2.9.1", ['nvidia-cuda-runtime-cu12==12.8.90; platform_system == "Linux"', "filelock"], True),
    ("2.9.1", ["filelock"], False),
])
def test_torch_gpu_build_detection(version, requires, gpu):
    assert packages.torch_is_gpu_build(version, requires) is gpu


def test_stale_install_metadata_is_reported_against_pyproject(tmp_path):
    # a checkout whose pyproject.toml declares only torch: every other installed requirement differs
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "rlcore"\nrequires-python = ">=3.99"\ndependencies = ["torch==2.13.0"]\n')
    declared = requirements.declared_requirements(tmp_path)
    assert declared.source == "pyproject.toml" and declared.dependencies == ("torch==2.13.0",)
    assert declared.requires_python == ">=3.99"
    assert "torch==2.13.0" not in declared.stale and "pyyaml>=6" in declared.stale
    check = python.check_python(Context(cfg=Config(), root=tmp_path))
    assert check.status == "fail" and ">=3.99" in check.detail


# --- thresholds ----------------------------------------------------------------------------------


def test_disk_thresholds():
    assert disk.disk_status(disk.DISK_WARN_GIB * GIB) == "ok"
    assert disk.disk_status(disk.DISK_WARN_GIB * GIB - 1) == "warn"
    assert disk.disk_status(disk.DISK_FAIL_GIB * GIB) == "warn"
    assert disk.disk_status(disk.DISK_FAIL_GIB * GIB - 1) == "fail"


def test_little_free_disk_fails_the_report(elsewhere, capsys, monkeypatch):
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: SimpleNamespace(free=0.5 * GIB))
    code, out = diagnose_cli(["--skip", f"{SLOW},mlflow"], capsys)
    assert code == 1
    assert [line.split()[1] for line in lines_of(out, "fail")] == ["disk"]
    assert "0.5 GiB free" in lines_of(out, "fail")[0]


def test_resource_shortfall_counts_cpus_and_gpus():
    cfg = parse_config({"resources": {"n_workers": 4, "cpus_per_worker": 1.5, "use_gpu": True}}, "test")
    assert ray_check.resource_shortfall(6, 4, cfg) is None
    short = ray_check.resource_shortfall(5, 3, cfg)
    assert "6 CPUs" in short and "has 5" in short and "4 GPUs" in short and "has 3" in short
    assert ray_check.resource_shortfall(6, 0, parse_config({"resources": {"n_workers": 4, "cpus_per_worker": 1.5}},
                                                          "test")) is None


def fake_torch(monkeypatch, devices: list[str], nccl: tuple[int, ...] | None) -> None:
    """A stand-in ``torch`` module with just what the torch check reads (importing the real one
    takes seconds, and this machine has no GPU)."""
    dist = SimpleNamespace(is_available=lambda: True, is_gloo_available=lambda: True,
                           is_nccl_available=lambda: nccl is not None)
    cuda = SimpleNamespace(is_available=lambda: bool(devices), device_count=lambda: len(devices),
                           get_device_name=lambda i: devices[i], nccl=SimpleNamespace(version=lambda: nccl))
    torch = SimpleNamespace(__version__="2.9.1+cu128" if devices else "2.13.0+cpu", cuda=cuda, distributed=dist,
                            version=SimpleNamespace(cuda="12.8" if devices else None, hip=None))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)


def test_torch_check_on_cpu_fails_only_when_params_ask_for_gpus(monkeypatch, tmp_path):
    fake_torch(monkeypatch, devices=[], nccl=None)
    cpu = torch_check.check_torch(Context(cfg=Config(), root=tmp_path))
    assert (cpu.status, cpu.detail) == ("ok", "2.13.0+cpu, CUDA: no (CPU only); gloo: yes")
    gpu_cfg = parse_config({"resources": {"use_gpu": True}}, "test")
    asked = torch_check.check_torch(Context(cfg=gpu_cfg, root=tmp_path))
    assert asked.status == "fail" and "resources.use_gpu" in asked.detail and "use_gpu: false" in asked.fix


def test_torch_check_lists_gpus_and_nccl(monkeypatch, tmp_path):
    fake_torch(monkeypatch, devices=["NVIDIA H100", "NVIDIA H100", "NVIDIA A10"], nccl=(2, 27, 3))
    gpu_cfg = parse_config({"resources": {"use_gpu": True}}, "test")
    check = torch_check.check_torch(Context(cfg=gpu_cfg, root=tmp_path))
    assert check.status == "ok"
    assert check.detail == "2.9.1+cu128, CUDA 12.8: 2 x NVIDIA H100, 1 x NVIDIA A10; NCCL: 2.27.3"
    fake_torch(monkeypatch, devices=["NVIDIA H100"], nccl=None)
    no_nccl = torch_check.check_torch(Context(cfg=gpu_cfg, root=tmp_path))
    assert no_nccl.status == "fail" and "NCCL: no" in no_nccl.detail


# --- failures made on purpose, through the command ------------------------------------------------


def test_sqlite_store_under_a_file_fails_with_exit_code_1(elsewhere, capsys):
    (elsewhere / "afile").write_text("not a folder")
    uri = f"sqlite:///{elsewhere}/afile/runs/mlflow.db"
    code, out = diagnose_cli(["--skip", SLOW, "--set", f"tracking.uri={uri}"], capsys)
    assert code == 1
    fails = lines_of(out, "fail")
    assert len(fails) == 1 and fails[0].split()[1] == "mlflow" and "afile is a file" in fails[0]
    assert out[out.index(fails[0]) + 1].strip().startswith("-> ")
    assert out[-1].endswith("not ready: fix the fail lines above")


def test_relative_sqlite_uri_resolves_against_the_repo(elsewhere):
    ctx = Context(cfg=parse_config({"tracking": {"uri": "sqlite:///store/mlflow.db"}}, "test"), root=elsewhere)
    check = mlflow_check.check_mlflow(ctx)
    assert check.status == "warn" and f"{elsewhere}/store does not exist" in check.detail
    assert check.fix == f"mkdir -p {elsewhere}/store"
    (elsewhere / "store").mkdir()
    assert mlflow_check.check_mlflow(ctx).status == "ok"


def fake_store(path: Path, revision: str, experiments: list[tuple[int, str, str]], runs: int) -> None:
    """An sqlite file with the tables (and only the columns) the MLflow check reads."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE alembic_version (version_num TEXT)")
    con.execute("INSERT INTO alembic_version VALUES (?)", (revision,))
    con.execute("CREATE TABLE experiments (experiment_id INTEGER, name TEXT, lifecycle_stage TEXT)")
    con.executemany("INSERT INTO experiments VALUES (?, ?, ?)", experiments)
    con.execute("CREATE TABLE runs (run_uuid TEXT, experiment_id INTEGER)")
    con.executemany("INSERT INTO runs VALUES (?, ?)", [(f"r{i}", experiments[0][0]) for i in range(runs)])
    con.commit()
    con.close()


def test_existing_sqlite_store_schema_and_experiment(tmp_path, monkeypatch):
    monkeypatch.setattr(mlflow_check, "mlflow_schema_head", lambda: "head1")
    ctx = Context(cfg=parse_config({"tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"}}, "test"), root=tmp_path)
    fake_store(tmp_path / "mlflow.db", "head1", [(1, "rlcore", "active")], runs=3)
    ok = mlflow_check.check_mlflow(ctx)
    assert ok.status == "ok" and "'rlcore' has 3 run(s)" in ok.detail
    (tmp_path / "mlflow.db").unlink()
    fake_store(tmp_path / "mlflow.db", "old0", [(1, "rlcore", "active")], runs=0)
    stale = mlflow_check.check_mlflow(ctx)
    assert stale.status == "fail" and "schema old0" in stale.detail and "mlflow db upgrade" in stale.fix
    (tmp_path / "mlflow.db").unlink()
    fake_store(tmp_path / "mlflow.db", "head1", [(7, "rlcore", "deleted")], runs=0)
    deleted = mlflow_check.check_mlflow(ctx)
    assert deleted.status == "fail" and "is deleted" in deleted.detail and "--experiment-id 7" in deleted.fix


def test_sqlite_file_that_is_not_an_mlflow_store_fails(tmp_path):
    con = sqlite3.connect(tmp_path / "other.db")
    con.execute("CREATE TABLE notes (x TEXT)")
    con.commit()
    con.close()
    (tmp_path / "garbage.db").write_bytes(b"\x00not sqlite at all" * 64)
    for name, words in [("other.db", "not an MLflow store"), ("garbage.db", "does not open as sqlite")]:
        ctx = Context(cfg=parse_config({"tracking": {"uri": f"sqlite:///{tmp_path}/{name}"}}, "test"), root=tmp_path)
        check = mlflow_check.check_mlflow(ctx)
        assert check.status == "fail" and words in check.detail, check


def test_unreachable_mlflow_server_fails(tmp_path):
    ctx = Context(cfg=parse_config({"tracking": {"uri": "http://127.0.0.1:1"}}, "test"), root=tmp_path, timeout_s=2)
    check = mlflow_check.check_mlflow(ctx)
    assert check.status == "fail" and "no answer" in check.detail and "mlflow server" in check.fix


def test_model_folder_without_config_json_fails(elsewhere, capsys):
    folder = elsewhere / "mymodel"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    code, out = diagnose_cli(["--skip", f"{SLOW},mlflow", "--set", "model.path=mymodel"], capsys)
    assert code == 1
    fails = lines_of(out, "fail")
    assert len(fails) == 1 and fails[0].split()[1] == "model"
    assert "'mymodel'" in fails[0] and "lacks config.json" in fails[0] and "a tokenizer (" not in fails[0]


def test_complete_model_folder_passes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    ctx = Context(cfg=parse_config({"model": {"path": str(tmp_path)}}, "test"), root=tmp_path)
    no_template = model.check_model(ctx)
    assert no_template.status == "fail" and "chat template" in no_template.detail
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    check = model.check_model(ctx)
    assert check.status == "ok" and "LlamaForCausalLM" in check.detail


def test_ray_address_nobody_listens_on_fails_before_starting_ray(elsewhere, capsys, monkeypatch):
    def no_probe(*args, **kwargs):
        raise AssertionError("the refused connection should end the check before Ray is started")

    monkeypatch.setattr(ray_check, "run_bounded", no_probe)
    code, out = diagnose_cli(["--skip", "torch,dvc,mlflow", "--timeout", "5", "--set", "ray.address=127.0.0.1:1"],
                             capsys)
    assert code == 1
    fails = lines_of(out, "fail")
    assert len(fails) == 1 and fails[0].split()[1] == "ray" and "127.0.0.1:1" in fails[0]
    assert "ray start --head --port 1" in out[out.index(fails[0]) + 1]


def probe_answering(monkeypatch, answer: dict) -> list[list[str]]:
    """Make the Ray child process answer ``answer`` (the real one takes seconds to start Ray)."""
    calls: list[list[str]] = []

    def fake_run_bounded(cmd, timeout_s, cwd=None):
        calls.append(cmd)
        return 0, "Ray says hello\n" + ray_check.PROBE_MARK + json.dumps(answer) + "\n", ""

    monkeypatch.setattr(ray_check, "run_bounded", fake_run_bounded)
    return calls


def test_ray_resources_are_compared_with_what_the_params_ask(monkeypatch, tmp_path):
    calls = probe_answering(monkeypatch, {"cpus": 1.0, "gpus": 0.0, "nodes": 1, "version": "2.60.0"})
    ctx = Context(cfg=parse_config({"ray": {"num_cpus": 1}}, "test"), root=tmp_path)
    short = ray_check.check_ray(ctx)
    assert "ray_probe('local', 1)" in calls[0][-1]
    assert short.status == "fail" and "needs 2 CPUs" in short.detail and "has 1" in short.detail
    assert "raise ray.num_cpus" in short.fix
    probe_answering(monkeypatch, {"cpus": 2.0, "gpus": 0.0, "nodes": 1, "version": "2.60.0"})
    ok = ray_check.check_ray(Context(cfg=parse_config({"ray": {"num_cpus": 2}}, "test"), root=tmp_path))
    assert ok.status == "ok" and ok.detail.startswith("local (private), Ray 2.60.0: 1 node(s), 2 CPUs, 0 GPUs")


def test_ray_error_from_the_probe_is_a_failure(monkeypatch, tmp_path):
    probe_answering(monkeypatch, {"error": "ConnectionError: Could not find any running Ray instance."})
    check = ray_check.check_ray(Context(cfg=parse_config({"ray": {"address": "auto"}}, "test"), root=tmp_path))
    assert check.status == "fail" and "Could not find any running Ray instance" in check.detail
    assert "ray start --head" in check.fix


def test_not_a_dvc_repo_fails(elsewhere, capsys):
    code, out = diagnose_cli(["--skip", "ray,torch,mlflow"], capsys)
    assert code == 1
    fails = lines_of(out, "fail")
    assert len(fails) == 1 and fails[0].split()[1] == "dvc" and "not a DVC repository" in fails[0]


def test_dvc_repo_without_a_git_commit_fails(tmp_path):
    (tmp_path / ".dvc").mkdir()
    ctx = Context(cfg=Config(), root=tmp_path)
    assert "not a git repository" in dvc_check.check_dvc(ctx).detail
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    check = dvc_check.check_dvc(ctx)
    assert check.status == "fail" and "without a commit" in check.detail and "git commit" in check.fix


def test_invalid_params_fail_their_line_and_the_report_goes_on(elsewhere, capsys):
    code, out = diagnose_cli(["--skip", f"{SLOW},mlflow,packages", "--set", "resources.n_workers=0"], capsys)
    assert code == 1
    fails = lines_of(out, "fail")
    assert len(fails) == 1 and fails[0].split()[1] == "params" and "resources.n_workers" in fails[0]
    assert [line.split()[1] for line in lines_of(out, "ok")] == ["python", "kernels", "disk", "model", "memory"]


def test_kernels_check_says_which_kernels_a_run_gets_and_fails_without_a_way_to_build_them(monkeypatch, tmp_path):
    from rlcore.diagnose import kernels_check
    from rlcore.engine import portable_ops

    ctx = Context(cfg=Config(), root=tmp_path)
    assert kernels_check.product_kernel({"avx2", "fma", "avx512f"}) == "avx512"
    assert kernels_check.product_kernel({"avx2", "fma"}) == "avx2" and kernels_check.product_kernel({"sse4_2"}) == "scalar"
    monkeypatch.setattr(portable_ops, "library_path", lambda: tmp_path / "not-built.so")
    monkeypatch.setenv("CXX", "no-such-compiler")
    check = kernels_check.check_kernels(ctx)
    assert check.status == "fail" and "no C++ compiler" in check.detail and "cpu_kernels: native" in check.fix
    native = kernels_check.check_kernels(Context(cfg=Config.model_validate({"resources": {"cpu_kernels": "native"}}),
                                                 root=tmp_path))
    assert native.status == "ok" and native.detail.startswith("native:")


def test_a_check_that_hangs_is_abandoned_and_fails(monkeypatch):
    monkeypatch.setattr(base, "GRACE_S", 0.0)
    def hangs(ctx):  # answers long after it was abandoned
        time.sleep(30)
        return diagnose.Check("slow", "ok", "too late")

    check = diagnose.run_check("slow", hangs, Context(cfg=Config(), root=Path("."), timeout_s=0.2))
    assert check.status == "fail" and "no answer within 0.2s" in check.detail


def test_a_check_that_raises_is_a_failure_not_a_crash(capsys):
    def broken(ctx):
        raise RuntimeError("boom")

    check = diagnose.run_check("broken", broken, Context(cfg=Config(), root=Path(".")))
    assert check.status == "fail" and check.detail == "the check raised RuntimeError: boom"
    assert "Traceback" in capsys.readouterr().err


def test_run_bounded_kills_a_child_past_its_deadline():
    # the child prints, then would sleep 30 s: None (not 0) says it was killed at the deadline
    rc, out, _ = base.run_bounded(["sh", "-c", "echo started; sleep 30"], 1.0)
    assert (rc, out) == (None, "started\n")
    assert base.run_bounded([sys.executable, "-c", "print('hi')"], 30)[:2] == (0, "hi\n")


def test_warn_and_fail_need_a_fix():
    with pytest.raises(ValueError, match="needs a fix"):
        Check("x", "warn", "something")
    with pytest.raises(ValueError, match="status"):
        Check("x", "bad", "something", "fix")  # type: ignore[arg-type]


# --- output --------------------------------------------------------------------------------------


def test_json_has_one_entry_per_check_and_passing_checks_are_ok(elsewhere, capsys):
    code, out = diagnose_cli(["--json", "--skip", SLOW, "--set", "tracking.enabled=false"], capsys)
    report = json.loads("\n".join(out))
    names = [c["name"] for c in report["checks"]]
    assert names == ["params", *(n for n in diagnose.CHECKS if n not in SLOW.split(","))]
    assert report["skipped"] == SLOW.split(",")
    by_name = {c["name"]: c for c in report["checks"]}
    # what this folder and the defaults give: no params.yaml, tracking off, the built-in model
    assert by_name["params"]["status"] == "ok" and "built-in defaults" in by_name["params"]["detail"]
    assert by_name["mlflow"]["status"] == "ok" and "tracking.enabled is false" in by_name["mlflow"]["detail"]
    assert by_name["model"]["status"] == "ok" and by_name["model"]["detail"].startswith("tiny")
    assert by_name["python"]["status"] == "ok"
    counts = {s: sum(c["status"] == s for c in report["checks"]) for s in diagnose.STATUSES}
    assert report["counts"] == counts and report["ok"] is (counts["fail"] == 0)
    assert code == (1 if counts["fail"] else 0)


def test_lines_are_plain_text_when_not_a_terminal(elsewhere, capsys):
    code, out = diagnose_cli(["--skip", SLOW, "--set", "tracking.enabled=false"], capsys)
    assert code == (1 if lines_of(out, "fail") else 0)
    assert not any("\033[" in line for line in out)
    assert out[0] == "ok    params    built-in defaults (no params.yaml here) with 1 --set override(s): valid"
    assert out[-1].startswith(f"{len(diagnose.CHECKS) - 3 + 1} checks: ")


def test_format_check_colours_the_status_and_adds_the_fix_line():
    from rlcore.commands.diagnose import format_check

    fail = Check("dvc", "fail", "not a DVC repository", "git init && dvc init")
    assert format_check(fail, colour=False) == "fail  dvc       not a DVC repository\n      -> git init && dvc init"
    assert format_check(fail, colour=True).startswith("\033[31mfail \033[0m dvc ")
    assert format_check(Check("disk", "ok", "9 GiB free"), colour=False) == "ok    disk      9 GiB free"


def test_unknown_check_name_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["diagnose", "--skip", "rya"])
    assert exc.value.code == 2 and "unknown check 'rya'" in capsys.readouterr().err


# --- the torch and Ray checks for real -------------------------------------------------------------


def marked_processes(mark: str) -> list[int]:
    """Processes of this user whose environment holds ``RLCORE_TEST_MARK=mark`` (the Ray probe's child process
    and every Ray process it started inherit it)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("RLCORE_TEST_MARK") == mark:
                found.append(proc.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def test_the_torch_and_ray_checks_run_for_real_and_leave_no_ray_behind(elsewhere, capsys, monkeypatch):
    """No stand-ins: the torch check imports the installed torch; the Ray check starts a private Ray with
    ray.num_cpus 2 in its child process, reads its resources and shuts it down. The expected lines are built
    from the installed versions and this machine's devices."""
    import importlib.metadata
    import os
    import uuid

    import torch

    mark = uuid.uuid4().hex
    monkeypatch.setenv("RLCORE_TEST_MARK", mark)
    code, out = diagnose_cli(["--json", "--skip", "python,packages,kernels,dvc,mlflow,disk,model,memory",
                              "--timeout", "120",
                              "--set", "ray.num_cpus=2"], capsys)
    checks = {c["name"]: c for c in json.loads("\n".join(out))["checks"]}
    assert list(checks) == ["params", "torch", "ray"]
    gpus = torch.cuda.device_count()
    if gpus:
        assert checks["torch"]["status"] == "ok" and f"CUDA {torch.version.cuda}" in checks["torch"]["detail"]
    else:
        assert (checks["torch"]["status"], checks["torch"]["detail"]) == (
            "ok", f"{importlib.metadata.version('torch')}, CUDA: no (CPU only); gloo: yes")
    ray_version = importlib.metadata.version("ray")
    expected = f"local (private), Ray {ray_version}: 1 node(s), 2 CPUs, {gpus} GPUs (the pipeline needs 2 CPUs)"
    if (os.cpu_count() or 1) >= 2:
        assert (checks["ray"]["status"], checks["ray"]["detail"]) == ("ok", expected), checks["ray"]
    else:  # more logical CPUs than cores: a warning, not a failure
        assert checks["ray"]["status"] == "warn" and checks["ray"]["detail"].startswith(expected), checks["ray"]
    assert code == 0
    deadline = time.monotonic() + 20  # the probe shut its Ray down: its raylet and GCS end with it
    while (left := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"Ray processes of the probe still running: {left}"
