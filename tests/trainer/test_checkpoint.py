"""Step checkpoints without Ray: the schedule, atomic commits, what a resume picks and refuses, pruning,
errors naming the path, and a worker's training state written and read back exactly.

The whole kill-and-resume path through the real stages is in tests/test_e2e_pipeline.py (SIGKILL of
``ppo@r1``) and tests/trainer/test_resume.py (SFT, in-process)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlcore.trainer.loop.checkpoint import CheckpointWriteError, StepCheckpoints, fingerprint


@pytest.fixture
def code_root(tmp_path) -> Path:
    """A stand-in repository: two code files and one input file."""
    for rel, text in (("rlcore/a.py", "x = 1\n"), ("stages/s.py", "y = 2\n"), ("data/in.txt", "rows\n")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def make(root: Path, params=None, keep_last: int = 0, save_every: int = 2) -> StepCheckpoints:
    params = params or {"seed": 1, "sft": {"lr": 0.1, "save_every": save_every}, "ray": {"num_cpus": 2}}
    fp = fingerprint(params, root=root, inputs=[root / "data/in.txt"])
    return StepCheckpoints(root / "ckpt" / "sft", stage="sft", save_every=save_every, keep_last=keep_last,
                           fingerprint=fp)


def save(ck: StepCheckpoints, step: int, payload: str = "x") -> Path:
    folder = ck.begin(step)
    (folder / "worker.bin").write_text(payload)
    return ck.commit(folder, step, {"payload": payload, "run_id": "run-1"})


def test_an_input_named_relatively_or_absolutely_is_one_input(code_root, monkeypatch):
    """A run that named its data absolutely (``--data /project/data/in.txt``), then run again from the project folder
    with the same file named relatively (or through ``./`` and ``..``), resumes: inputs are named relative to the
    root. One outside the root is named by its absolute path, however it was given."""
    params = {"seed": 1, "sft": {"lr": 0.1, "save_every": 2}}

    def checkpoints(inputs) -> StepCheckpoints:
        return StepCheckpoints(code_root / "ckpt" / "sft", stage="sft", save_every=2, keep_last=0,
                               fingerprint=fingerprint(params, root=code_root, inputs=inputs))

    save(checkpoints([code_root / "data/in.txt"]), 2)
    monkeypatch.chdir(code_root)
    for named in ("data/in.txt", "./data/../data/in.txt"):
        resume = checkpoints([named]).resume()
        assert resume is not None and resume.step == 2, named
    assert list(checkpoints(["data/in.txt"]).fingerprint["data"]) == ["data/in.txt"]
    outside = code_root.parent / f"{code_root.name}-outside.txt"
    outside.write_text("rows\n")
    monkeypatch.chdir(code_root.parent)
    assert list(fingerprint(params, root=code_root, inputs=[outside.name])["data"]) == [str(outside)]


def test_due_every_n_steps_but_never_after_the_last():
    ck = StepCheckpoints("unused", stage="sft", save_every=3, keep_last=0, fingerprint={})
    assert [d for d in range(1, 11) if ck.due(d, 9)] == [3, 6]
    off = StepCheckpoints("unused", stage="sft", save_every=0, keep_last=0, fingerprint={})
    assert not any(off.due(d, 9) for d in range(1, 10))


def test_resume_picks_the_newest_complete_checkpoint_and_ignores_a_partial_one(code_root, capsys):
    ck = make(code_root, keep_last=3)
    save(ck, 2, "two")
    save(ck, 4, "four")
    partial = ck.begin(6)  # a kill while step 6 was being written: no controller file, not renamed
    (partial / "worker.bin").write_text("half")
    resume = make(code_root, keep_last=3).resume()
    assert resume is not None and (resume.step, resume.state["payload"], resume.run_id) == (4, "four", "run-1")
    assert (resume.folder / "worker.bin").read_text() == "four"
    assert not partial.exists()
    assert capsys.readouterr().out.strip() == f"resuming sft from step 4 ({resume.folder})"


def test_while_running_only_the_newest_are_kept_and_success_removes_them(code_root):
    ck = make(code_root, keep_last=0)
    for step in (2, 4, 6):
        save(ck, step)
    assert [s for s, _ in ck.complete()] == [6]  # max(keep_last, 1) while running
    ck.finish()
    assert not ck.folder.exists()

    kept = make(code_root, keep_last=2)
    for step in (2, 4, 6):
        save(kept, step)
    kept.finish()
    assert [s for s, _ in kept.complete()] == [4, 6]


@pytest.mark.parametrize("change, reason", [
    (lambda root: {"seed": 1, "sft": {"lr": 0.2, "save_every": 2}, "ray": {"num_cpus": 2}},
     "params changed: sft.lr 0.1 -> 0.2"),
    (lambda root: (root / "rlcore/a.py").write_text("x = 3\n"), "code changed: rlcore/a.py modified"),
    (lambda root: (root / "rlcore/new.py").write_text(""), "code changed: rlcore/new.py added"),
    (lambda root: (root / "data/in.txt").write_text("other rows\n"), "input data changed:"),
])
def test_a_checkpoint_of_other_params_code_or_data_is_refused_saying_why(code_root, capsys, change, reason):
    save(make(code_root), 2)
    params = change(code_root)
    ck = make(code_root, params=params if isinstance(params, dict) else None)
    assert ck.resume() is None
    err = capsys.readouterr().err
    assert reason in err and "starting over" in err
    assert not ck.complete()  # the stale checkpoint is gone


def test_settings_that_cannot_change_results_do_not_invalidate(code_root):
    save(make(code_root, save_every=2), 2)
    params = {"seed": 1, "sft": {"lr": 0.1, "save_every": 5}, "ray": {"num_cpus": 8}}
    assert make(code_root, params=params, save_every=5).resume() is not None


def test_every_training_sections_checkpoint_cadence_and_divergence_limit_are_left_out_of_the_fingerprint(tmp_path):
    """What only says how often to checkpoint or when to stop cannot change the steps a checkpoint holds; the
    optimizer's settings can."""
    def params(**rm):
        return {"sft": {"lr": 0.1, "save_every": 1}, "rm": {"lr": 0.1, "save_every": 200, "max_nonfinite_steps": 3,
                                                           **rm}}

    def prints(p):
        return fingerprint(p, root=tmp_path, inputs=[], code=[])["params"]

    assert prints(params(save_every=5, max_nonfinite_steps=0)) == prints(params()) == {"sft.lr": 0.1, "rm.lr": 0.1}
    assert prints(params(lr=0.2)) != prints(params())
    # what a stage adds to its declared sections (the recorded hashes of its reward files) counts as it is
    recorded = {**params(), "reward_inputs": {"fn_f": "ab12"}}
    assert prints(recorded) == {"sft.lr": 0.1, "rm.lr": 0.1, "reward_inputs.fn_f": "ab12"}


def test_an_unwritable_checkpoint_folder_is_one_error_naming_it(code_root):
    blocker = code_root / "ckpt"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(CheckpointWriteError, match=r"ckpt/sft/step_00000002\.tmp"):
        make(code_root).begin(2)


def test_a_worker_that_ran_out_of_space_is_one_error_and_the_previous_checkpoint_stays(code_root):
    ck = make(code_root)
    save(ck, 2, "two")
    folder = ck.begin(4)
    err = ck.worker_error(folder, RuntimeError("ray task failed: OSError: [Errno 28] No space left on device"))
    assert isinstance(err, CheckpointWriteError) and "step_00000004.tmp" in str(err) and "No space left" in str(err)
    assert not folder.exists() and [s for s, _ in ck.complete()] == [2]
    bug = ValueError("a bug")
    assert ck.worker_error(ck.begin(4), bug) is bug  # not a filesystem error: it keeps its traceback


def test_training_state_round_trips_weights_optimizer_schedule_and_rng(tmp_path):
    from rlcore.workers.optim import OptimSpec, make_optimizer
    from rlcore.workers.state import load_training_state, save_training_state

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        return model, *make_optimizer(model, OptimSpec(lr=0.05, warmup_steps=2, total_steps=6))

    def train(model, opt, sched, steps):
        for _ in range(steps):
            model(torch.randn(5, 4)).pow(2).sum().backward()  # draws from the global RNG
            opt.step()
            opt.zero_grad()
            sched.step()

    a = build(0)
    train(*a, 2)
    save_training_state(tmp_path, "m", SimpleNamespace(module=a[0]), a[1], a[2], rank=0)
    train(*a, 3)  # the uninterrupted run
    b = build(1)  # another process's fresh model, optimizer and RNG
    load_training_state(tmp_path, "m", SimpleNamespace(module=b[0]), b[1], b[2], rank=0)
    train(*b, 3)  # the resumed run
    for (k, va), vb in zip(a[0].state_dict().items(), b[0].state_dict().values()):
        assert torch.equal(va, vb), k
    assert a[2].get_last_lr() == b[2].get_last_lr()


@pytest.mark.parametrize("spoil, reason", [
    (lambda folder: (folder / "worker.bin").write_text("cut"), "incomplete: worker.bin has 3 bytes, 4 were written"),
    (lambda folder: (folder / "worker.bin").unlink(), "incomplete: worker.bin is missing"),
    (lambda folder: (folder / "controller.pt").write_bytes(b"not a torch file"), "unreadable (UnpicklingError"),
])
def test_an_unusable_newest_checkpoint_is_removed_saying_why_and_the_older_one_resumed(code_root, capsys, spoil,
                                                                                      reason):
    ck = make(code_root, keep_last=3)
    save(ck, 2, "two!")
    newest = save(ck, 4, "four")
    spoil(newest)
    resume = make(code_root, keep_last=3).resume()
    assert resume is not None and (resume.step, resume.state["payload"]) == (2, "two!")
    captured = capsys.readouterr()
    assert f"sft: not resuming from {newest}: {reason}" in captured.err and "removed it" in captured.err
    assert captured.out.strip() == f"resuming sft from step 2 ({resume.folder})"
    assert [s for s, _ in ck.complete()] == [2] and not newest.exists()


def test_only_the_checkpoints_of_other_params_are_removed_and_a_matching_older_one_is_kept(code_root, capsys):
    other = {"seed": 1, "sft": {"lr": 0.3, "save_every": 2}, "ray": {"num_cpus": 2}}
    save(make(code_root, keep_last=3), 2, "mine")  # written under this run's params
    newer = save(make(code_root, params=other, keep_last=3), 4, "other")  # then under other params
    resume = make(code_root, keep_last=3).resume()
    assert resume is not None and (resume.step, resume.state["payload"]) == (2, "mine")
    assert "params changed: sft.lr 0.3 -> 0.1" in capsys.readouterr().err and not newer.exists()


def stage_root(root: Path) -> Path:
    """``code_root`` with a dvc.yaml whose sft stage depends on rlcore/a.py, the folder rlcore/pkg and its script;
    rlcore/other.py belongs to no stage."""
    (root / "rlcore/pkg").mkdir()
    (root / "rlcore/pkg/b.py").write_text("z = 1\n")
    (root / "rlcore/pkg/page.js").write_text("var x = 1;\n")
    (root / "rlcore/other.py").write_text("w = 1\n")
    (root / "dvc.yaml").write_text(
        "stages:\n  sft:\n    cmd: python -m stages.s\n    deps:\n      - stages/s.py\n      - rlcore/a.py\n"
        "      - rlcore/pkg\n      - data/in.txt\n  ppo:\n    foreach: [r1]\n    do:\n      cmd: x\n"
        "      deps:\n        - rlcore/other.py\n")
    return root


def staged(root: Path) -> StepCheckpoints:
    from rlcore.trainer.loop.checkpoint import stage_code

    params = {"seed": 1, "sft": {"lr": 0.1, "save_every": 2}}
    fp = fingerprint(params, root=root, inputs=[root / "data/in.txt"], code=stage_code(root, "sft"))
    return StepCheckpoints(root / "ckpt" / "sft", stage="sft", save_every=2, keep_last=0, fingerprint=fp)


def test_the_code_fingerprint_is_the_stages_own_dvc_dependencies(code_root, capsys):
    from rlcore.trainer.loop.checkpoint import stage_code

    root = stage_root(code_root)
    assert stage_code(root, "sft") == ["stages/s.py", "rlcore/a.py", "rlcore/pkg"]
    assert stage_code(root, "ppo@r1") == ["rlcore/other.py"] and stage_code(root, "nope") is None
    assert sorted(staged(root).fingerprint["code"]) == ["rlcore/a.py", "rlcore/pkg/b.py", "rlcore/pkg/page.js",
                                                        "stages/s.py"]
    save(staged(root), 2)
    (root / "rlcore/other.py").write_text("w = 2\n")  # another stage's module: the checkpoint stays usable
    assert staged(root).resume() is not None
    (root / "rlcore/pkg/page.js").write_text("var x = 2;\n")  # a file of a folder the stage depends on
    assert staged(root).resume() is None
    assert "code changed: rlcore/pkg/page.js modified" in capsys.readouterr().err


def test_the_real_sft_stage_keeps_its_checkpoints_when_the_server_code_changes():
    """On this repository's dvc.yaml: sft runs its worker and checkpoint code, not the HTTP server's."""
    from rlcore.trainer.loop.checkpoint import code_digests, stage_code

    from ..conftest import REPO_ROOT

    code = code_digests(REPO_ROOT, stage_code(REPO_ROOT, "sft"))
    assert {"stages/sft.py", "rlcore/workers/sft.py", "rlcore/trainer/loop/checkpoint.py"} <= set(code)
    assert not [f for f in code if f.startswith(("rlcore/serve/", "rlcore/trainer/ppo", "rlcore/algos/losses"))]
    ppo = code_digests(REPO_ROOT, stage_code(REPO_ROOT, "ppo@r1"))
    assert "rlcore/algos/losses.py" in ppo and "rlcore/viewer/page.js" in ppo
    assert "rlcore/serve/app.py" in ppo  # a round may run an agent program against the endpoint (the server's app)
