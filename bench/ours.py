"""Our side of the benchmark: rlcore's RoundRunner (single controller + 2 Ray FSDP2 ranks).

Started by ``bench.run_bench`` as a child process; it builds the runner, then runs
``K`` RL steps per ``run K`` command and reports one record per step (``bench.wire``).
Each of the 2 worker ranks runs torch with 1 thread (rlcore's resources.cpus_per_worker).

    .venv/bin/python -m bench.ours      # then type: run 2 / quit
"""

from __future__ import annotations

import inspect
import os
import time

os.environ.setdefault("TQDM_DISABLE", "1")

from bench import wire  # noqa: E402
from bench.settings import RL_SEED, paths, rl_config  # noqa: E402


def build_runner(total_steps: int):
    from rlcore.data.collate import prompt_batch
    from rlcore.data.schema import read_rows
    from rlcore.engine.model import load_tokenizer
    from rlcore.trainer.ppo import RoundRunner

    cfg, p = rl_config(), paths()
    tok = load_tokenizer(p["sft"])
    prompts = prompt_batch(read_rows(p["rl_data"]), tok, cfg.task.max_prompt_length, str(p["rl_data"]))
    kwargs = {"total_steps": total_steps} if "total_steps" in inspect.signature(RoundRunner).parameters else {}
    return RoundRunner(cfg, init_dir=str(p["sft"]), tokenizer=tok, prompts=prompts, seed=RL_SEED, **kwargs)


def step_record(step: int, m: dict[str, float], wall: float) -> dict:
    """Token counts are recovered from rlcore's own rates: rate x the time it divides by."""
    phases = {k.removeprefix("timing_s/"): v for k, v in m.items() if k.startswith("timing_s/")}
    return {
        "step": step, "wall_s": wall, "gen_s": m["timing_s/gen"], "reward": m["rollout/acc"],
        "rollout_tokens": round(m["perf/gen_tokens_per_s"] * m["timing_s/gen"]),
        "train_tokens": round(m["perf/tokens_per_s"] * m["timing_s/step"]),
        "phases": phases, "kl": m.get("actor/kl_ref"), "response_length": m["rollout/response_length"],
    }


def main() -> None:
    t0 = time.perf_counter()
    runner = build_runner(total_steps=10_000)
    wire.emit("ready", setup_s=time.perf_counter() - t0, pid=os.getpid())
    step = 0
    while (cmd := wire.next_command())[0] == "run":
        for _ in range(cmd[1]):
            start = time.perf_counter()
            m = runner.step(step)
            wire.emit("step", **step_record(step, m, time.perf_counter() - start))
            step += 1
        wire.emit("paused", step=step)
    runner.close()
    wire.emit("closed")


if __name__ == "__main__":
    main()
