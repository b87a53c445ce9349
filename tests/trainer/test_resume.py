"""SFT and reward-model training resumed from a step checkpoint end exactly as the uninterrupted run: the same
metric rows, the same weights (in-process, on the session's Ray; the SIGKILL of a real stage is in
tests/test_e2e_pipeline.py)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from rlcore.config import parse_config
from rlcore.data.arithmetic import arithmetic_rows
from rlcore.data.schema import write_rows
from rlcore.tracking import NullTracker
from rlcore.trainer.loop.checkpoint import Resume, StepCheckpoints
from rlcore.trainer.sft import run_sft


def plot_rows(path: Path) -> list[dict[str, str]]:
    """The plot CSV without the wall-clock columns (those differ between any two runs)."""
    return [{k: v for k, v in r.items() if not k.startswith("timing")} for r in csv.DictReader(path.open())]


def checkpoints_for(name: str, root: Path, stage: str) -> tuple[StepCheckpoints, Resume | None]:
    """The step checkpoints of the ``whole`` run (every 2 steps, into ``root/ckpt``), or for the ``resumed`` run the
    newest of them (step 4 of 5) and no more saving."""
    ck = StepCheckpoints(root / "ckpt", stage=stage, save_every=2, keep_last=0, fingerprint={})
    if name == "whole":
        return ck, None
    resume = ck.resume()
    assert resume is not None and resume.step == 4  # the newest of steps 2 and 4 (5 is the last)
    return StepCheckpoints(root / "unused", stage=stage, save_every=0, keep_last=0, fingerprint={}), resume


@pytest.mark.integration
def test_sft_resumed_from_a_checkpoint_ends_as_the_uninterrupted_run(ray_local, tiny_model_dir, tiny_tokenizer,
                                                                     tmp_path):
    """Under fsdp: the sharded optimizer state goes through one unsharded file and back into shards
    (the default ddp is the SIGKILL test's, on a real stage)."""
    data = tmp_path / "sft.parquet"
    write_rows(arithmetic_rows(n=24, seed=3, split="sft", min_digits=1, max_digits=2, ops=("+",)), data)
    cfg = parse_config({"resources": {"n_workers": 2, "strategy": "fsdp"},
                        "sft": {"steps": 5, "batch_size": 8, "micro_batch_size": 4, "warmup_steps": 1,
                                "save_every": 2}})
    runs = {}
    for name in ("whole", "resumed"):
        ck, resume = checkpoints_for(name, tmp_path, "sft")
        run_sft(cfg, base_model=tiny_model_dir, tokenizer=tiny_tokenizer, data_path=str(data),
                out_dir=str(tmp_path / name), tracker=NullTracker(), plot_csv=str(tmp_path / f"{name}.csv"),
                checkpoints=ck, resume=resume)
        runs[name] = plot_rows(tmp_path / f"{name}.csv")
    assert runs["resumed"] == runs["whole"] and len(runs["whole"]) == 5
    whole = (tmp_path / "whole" / "model.safetensors").read_bytes()
    assert (tmp_path / "resumed" / "model.safetensors").read_bytes() == whole


@pytest.mark.integration
def test_a_reward_model_resumed_from_a_checkpoint_ends_as_the_uninterrupted_run(ray_local, tiny_model_dir,
                                                                               tiny_tokenizer, tmp_path):
    """rm.save_every: the resumed run's metric rows (held-out accuracy across the resume point included), saved
    model and normalisation statistics are those of the run that was never stopped."""
    import pandas as pd

    from rlcore.trainer.rm import run_rm

    records = [{"prompt": f"{a}+{b}", "chosen": f"{a + b}!", "rejected": f"{a + b + 1}"}
               for a in range(8) for b in range(5)]
    pd.DataFrame(records[:32]).to_parquet(tmp_path / "train.parquet")
    pd.DataFrame(records[32:]).to_parquet(tmp_path / "test.parquet")
    cfg = parse_config({"rm": {"steps": 5, "batch_size": 8, "lr": 0.01, "warmup_steps": 1, "eval_every": 3,
                               "save_every": 2}})
    runs, metrics = {}, {}
    for name in ("whole", "resumed"):
        ck, resume = checkpoints_for(name, tmp_path, "rm@rm")
        metrics[name] = run_rm(cfg, init=str(tiny_model_dir), tokenizer=tiny_tokenizer,
                               train_path=str(tmp_path / "train.parquet"), test_path=str(tmp_path / "test.parquet"),
                               out_dir=str(tmp_path / name), tracker=NullTracker(),
                               plot_csv=str(tmp_path / f"{name}.csv"), checkpoints=ck, resume=resume)
        runs[name] = plot_rows(tmp_path / f"{name}.csv")
    assert runs["resumed"] == runs["whole"] and len(runs["whole"]) == 6  # 5 steps and the final held-out row
    assert metrics["resumed"] == metrics["whole"]
    for file in ("model.safetensors", "reward_stats.json"):
        assert (tmp_path / "resumed" / file).read_bytes() == (tmp_path / "whole" / file).read_bytes()
