"""PPO rounds whose samples are agent programs' trajectories (rollout.agent.loop openai) on Ray workers: a round
stopped at a step checkpoint and resumed, and an asynchronous round (its generator worker running the agents), end
with the uninterrupted synchronous round's metric rows and weights, bit for bit; the agents' split conversations
train as extra rows (padded over the two ranks) and their metrics are logged."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from rlcore.config import parse_config
from rlcore.data.arithmetic import arithmetic_rows
from rlcore.data.schema import write_rows
from rlcore.tracking import NullTracker
from rlcore.trainer.loop.checkpoint import StepCheckpoints
from rlcore.trainer.ppo import run_ppo_round

AGENT = Path(__file__).parent / "openai_round_agent" / "agent.py"


def plot_rows(path: Path) -> list[dict[str, str]]:
    """The plot CSV without what measures time or the async queue."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing", "perf", "async", "rollout/sample_tries"))}
            for r in csv.DictReader(path.open())]


def config(mode: str = "sync"):
    return parse_config({
        "ray": {"num_cpus": 2}, "tracking": {"enabled": False}, "resources": {"n_workers": 2, "cpus_per_worker": 0.5},
        "task": {"max_prompt_length": 16, "max_response_length": 48},
        "rollout": {"n": 2, "n_workers": 1, "cpus_per_worker": 0.5,
                    "agent": {"loop": "openai", "agents": [{"path": str(AGENT), "name": "run"}], "processes": 1,
                              "max_turns": 3, "agent_timeout_s": 120}},
        "actor": {"ppo_mini_batch_size": 3, "lr": 1e-3, "warmup_steps": 0},
        "ppo": {"train_batch_size": 3, "save_every": 2, "val_every": 0, "mode": mode,
                "async": {"max_staleness": 0, "queue_size": 1}, "rounds": {"r1": {"init": "models/sft", "steps": 3}}}})


@pytest.mark.integration
def test_agent_rounds_resume_and_run_async_to_the_same_bits(ray_local, tiny_model_dir, tiny_tokenizer, tmp_path):
    data = tmp_path / "rl.parquet"
    write_rows(arithmetic_rows(n=6, seed=1, split="rl", min_digits=1, max_digits=1, ops=("+",)), data)
    ran = {}
    for name, mode in (("whole", "sync"), ("resumed", "sync"), ("async", "async")):
        ck = StepCheckpoints(tmp_path / f"ckpt_{mode}", stage="ppo@r1", save_every=2, keep_last=0, fingerprint={})
        resume = ck.resume() if name == "resumed" else None
        assert (resume is not None and resume.step == 2) == (name == "resumed")
        metrics = run_ppo_round(config(mode), round_name="r1", init_dir=str(tiny_model_dir), tokenizer=tiny_tokenizer,
                                data_path=str(data), out_dir=str(tmp_path / name), tracker=NullTracker(),
                                plot_csv=str(tmp_path / f"{name}.csv"), checkpoints=ck, resume=resume)
        ran[name] = plot_rows(tmp_path / f"{name}.csv"), (tmp_path / name / "model.safetensors").read_bytes()
    whole_rows, whole_model = ran["whole"]
    assert len(whole_rows) == 3
    for name in ("resumed", "async"):
        assert ran[name][0] == whole_rows, name
        assert ran[name][1] == whole_model, name
    last = whole_rows[-1]
    assert float(last["agent/split"]) > 0 and float(last["agent/rows_per_trajectory"]) > 1  # the odd rows edit
    assert float(last["agent/failures"]) == 0 and float(last["agent/requests"]) == 2
    assert metrics["ppo/agent/turns_last10"] == 2.0
