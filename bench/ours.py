"""Our side of the benchmark: rlcore's RoundRunner (single controller + 2 Ray data-parallel ranks).

Started by ``bench.run_bench`` as a child process; it builds the runner, then runs
``K`` RL steps per ``run K`` command and reports one record per step (``bench.wire``).
Each of the 2 worker ranks runs torch with 1 thread (rlcore's resources.cpus_per_worker).

    .venv/bin/python -m bench.ours      # then type: run 2 / quit
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TQDM_DISABLE", "1")

from bench import wire  # noqa: E402
from bench.settings import RL_SEED, paths, rl_config  # noqa: E402


def ours_overrides() -> dict:
    """Extra rlcore config keys for our side only (``run_bench --ours-set``), JSON in BENCH_OURS_SET."""
    return json.loads(os.environ.get("BENCH_OURS_SET") or "{}")


def running_runner():
    """rlcore's RoundRunner over its worker groups (a context manager that stops them)."""
    from rlcore.data.collate import prompt_batch
    from rlcore.data.schema import read_rows
    from rlcore.engine.model import load_tokenizer
    from rlcore.trainer.round.modes import running_round

    cfg, p = rl_config(ours_overrides()), paths()
    tok = load_tokenizer(p["sft"])
    prompts = prompt_batch(read_rows(p["rl_data"]), tok, cfg.task.max_prompt_length, str(p["rl_data"]))
    return running_round(cfg, init_dir=str(p["sft"]), tokenizer=tok, prompts=prompts, seed=RL_SEED)


def step_record(step: int, m: dict[str, float], wall: float) -> dict:
    """Token counts are recovered from rlcore's own rates: rate x the time it divides by."""
    phases = {k.removeprefix("timing_s/"): v for k, v in m.items() if k.startswith("timing_s/")}
    # each phase's peak resident memory on the largest rank (rlcore.engine.peak_memory)
    memory = {k.removeprefix("perf/peak_mem_").removesuffix("_mib"): v for k, v in m.items()
              if k.startswith("perf/peak_mem_")}
    return {"memory_mib": memory,
        "step": step, "wall_s": wall, "gen_s": m["timing_s/gen"], "reward": m["rollout/acc"],
        "rollout_tokens": round(m["perf/gen_tokens_per_s"] * m["timing_s/gen"]),
        "train_tokens": round(m["perf/tokens_per_s"] * m["timing_s/step"]),
        "phases": phases, "kl": m.get("actor/kl_ref"), "response_length": m["rollout/response_length"],
    }


def _rss_mib(worker) -> float:
    """Runs inside a worker rank: its resident memory now (MiB)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rank_baselines(runner) -> list[float]:
    """Each rank's resident memory after set-up (models loaded, before any step)."""
    import ray

    return ray.get([w.__ray_call__.remote(_rss_mib) for w in runner.actor.workers])


def _noop(worker) -> None:
    """Runs inside a worker rank (``__ray_call__``): nothing, for the bare round-trip time."""


def _swallow(worker, batch) -> None:
    """Runs inside a worker rank: receive a Batch, send nothing back."""


def _echo(worker, batch):
    """Runs inside a worker rank: send the Batch straight back."""
    return batch


def step_sized_batch(runner):
    """A Batch with the fields and sizes of one step's update_actor input (random contents)."""
    import numpy as np
    import torch

    from rlcore.protocol import Batch

    cfg = runner.cfg
    prompts = runner.source.prompts.select(np.arange(cfg.ppo.train_batch_size)).repeat(cfg.rollout.n)
    rows, width = len(prompts), cfg.task.max_response_length
    floats = ("rollout_log_probs", "old_log_probs", "ref_log_probs", "token_level_rewards", "advantages", "returns")
    return prompts.union(Batch({"responses": torch.randint(0, 100, (rows, width)),
                                "response_mask": torch.ones(rows, width, dtype=torch.long),
                                "acc": torch.zeros(rows), "scores": torch.zeros(rows),
                                **{k: torch.randn(rows, width) for k in floats}}))


def ray_probe(runner, reps: int) -> dict[str, float]:
    """Median seconds of one call to all ranks (as WorkerGroup.call makes it, chunking included):
    empty, carrying one step's Batch in (and its tensors alone), and carrying it in and back out."""
    import statistics

    import ray

    from rlcore.protocol import Batch

    workers, full = runner.actor.workers, step_sized_batch(runner)
    tensors_only = Batch(dict(full.tensors))

    def timed(fn, batch) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            args = [(c,) for c in batch.chunk(len(workers))] if batch is not None else [()] * len(workers)
            ray.get([w.__ray_call__.remote(fn, *a) for w, a in zip(workers, args)])
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return {"empty_call_s": timed(_noop, None), "batch_in_s": timed(_swallow, full),
            "batch_in_out_s": timed(_echo, full), "tensors_only_in_s": timed(_swallow, tensors_only),
            "calls_per_step": 2}


def main() -> None:
    from rlcore.kernels import activate, pin

    if warning := pin(rl_config(ours_overrides()).resources.cpu_kernels):  # before torch, as a stage does
        print(warning, file=sys.stderr, flush=True)
    activate(None)
    t0 = time.perf_counter()
    with running_runner() as runner:
        wire.emit("ready", setup_s=time.perf_counter() - t0, pid=os.getpid(), overrides=ours_overrides(),
                  rank_rss_mib=rank_baselines(runner), controller_rss_mib=_rss_mib(None),
                  resources=runner.cfg.resources.model_dump(mode="json"),
                  packed_forward=runner.cfg.model.packed_forward, balance_batch=runner.cfg.ppo.balance_batch,
                  engine=runner.cfg.rollout.engine)
        step = 0
        while (cmd := wire.next_command())[0] in ("run", "probe"):
            if cmd[0] == "probe":
                wire.emit("probe", **ray_probe(runner, cmd[1]))
                continue
            for _ in range(cmd[1]):
                start = time.perf_counter()
                m = runner.step(step)
                wire.emit("step", **step_record(step, m, time.perf_counter() - start))
                step += 1
            wire.emit("paused", step=step)
    wire.emit("closed")


if __name__ == "__main__":
    main()
