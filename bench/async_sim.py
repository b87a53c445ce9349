"""Discrete-event simulation of synchronous vs asynchronous RL training at 8-64 GPUs, long-tailed responses.

The 2-core development machine cannot show what asynchronous PPO (``ppo.mode: async``) gains at scale, so this
predicts it from a cost model calibrated with measured times, and checks the model on the one configuration we
can measure (``--calibration``, the small-machine mode below).

    .venv/bin/python -m bench.async_sim                                   # defaults: ~7B model, H100-class GPUs
    .venv/bin/python -m bench.async_sim --calibration bench/_work/async/calibration.json --json sim.json

Model
-----
* Cost of one decode step on one GPU: ``t_tok_fixed + t_tok_row * active_rows`` (weights read once per step,
  plus per-row KV/compute); a finished row leaves the batch. Prefill: ``prompt_len * t_prefill_tok`` per row.
  Training: ``t_train_per_token * tokens / GPUs + t_sync_fixed`` (tokens = prompt + response of every sample).
* Sync (colocated, verl-style): all G GPUs generate the step's B x n rows (contiguous even split, each GPU
  batches up to ``max_rows`` rows and refills from its own share), so a GPU's generation time is
  ``prefill + t_tok_fixed * decode_steps + t_tok_row * its tokens`` with decode_steps = its longest response
  (its slot makespan when it holds more than ``max_rows`` rows); the step waits for the slowest GPU, then all G
  GPUs train, then reload the weights into the inference engine (``t_reload``). Step = gen + train + reload.
* Async (AReaL/ROLL-style, disaggregated): G_gen GPUs generate with continuous batching (a finished row is
  replaced at once from a shared FIFO of rows, up to ``max_rows`` per GPU), G_train = G - G_gen train. A
  prompt group belongs to the step it is handed out for (group index // B); it may only be started once the
  published version v >= step - s (s = ``max_staleness``; AReaL's ``max_head_offpolicyness`` gate, rlcore's
  "at most s+1 outstanding batches"), otherwise generators idle. The trainer trains step k on step k's B
  groups once all are complete (in order: no sample is dropped and none is short-biased), then publishes the
  weights (``t_weight_sync``; generators pause meanwhile unless ``--no-pause-on-sync``; AReaL interrupts
  generation for the update). Staleness of a group = trainer version - version when the group was started
  (the oldest weights any of its tokens came from), so it is <= s by construction; the tests check it.
  Generators keep going (gated) past the last step, so every measured step is steady state; the first
  ``--warmup`` steps (pipeline filling) are not measured.
* The G_gen/G_train split is searched, as AReaL and ROLL tune it: every split for G <= 8, else a grid of step
  G/8, the split balancing saturated generation against training +-2 and the fixed ratio, then hill-climbing by
  one GPU (throughput is not unimodal in it: more generating GPUs also means fewer rows each, so cheaper decode
  steps and a shorter tail). The fixed ratio (``--split-ratio``, 50/50) is reported too.
* Response lengths (tokens): a mixture, each row independently: with probability ``p_long`` a lognormal with
  median ``long_median``, else one with median ``short_median``; rounded, clipped to [1, max_len].

Event loop: a plain ``heapq`` loop, not simpy. The model has three event kinds (a GPU's next row completion,
end of an update, end of a weight sync) and the generator GPUs' state changes between events are closed-form
(constant decode-step cost while the active rows do not change), so simpy's processes would add a dependency
and per-event coroutine overhead and nothing else; this loop runs well over 100k row completions per second.

Defaults (the 7B / H100 costs are assumptions, justified where they are defined: ``Costs``)
-------------------------------------------------------------------------------------------
Lengths: short median 1000, sigma 0.6; 10% long with median 6000, sigma 0.5; cap 16384 -> mean ~1.76k tokens,
a long tail to the cap. Caps of 8k-16k tokens are usual in math-reasoning RL recipes (an R1-Zero-style
replication on verl found while writing this uses 16,384), and ROLL Flash's introduction describes response
lengths as long-tailed; the exact shape is our choice (we found no length distribution in the AReaL text we
could read), change it with the flags. Batch: 256 prompts x 16 responses; max_staleness 1 (rlcore's
default); AReaL's docs use max_head_offpolicyness 4 in their example (typical 2-8), so s in {0, 1, 2, 4} is
swept too.

Calibration (``--calibration FILE``, JSON)
------------------------------------------
Top-level numbers (all optional; per GPU; they replace the defaults for the 8-64 GPU tables, flags override
both): ``gen_s_per_decode_step`` (t_tok_fixed), ``gen_s_per_row_token`` (t_tok_row), ``gen_s_per_prefill_token``,
``train_s_per_token``, ``train_s_fixed`` (t_sync_fixed), ``reload_s``, ``weight_sync_s``.

Workload sections (what ``bench/async_bench.py`` writes: ``{"default": {...}, "long-tail": {...}}``), measured
on the 2-core machine, drive the small-machine mode: ``samples_per_step``, ``sync_gen_s``, ``sync_update_s``,
``sync_step_s`` (medians per step), ``mean_response_length``, ``sync_samples_per_s``, ``async_samples_per_s``,
``measured_async_over_sync``; optional: ``n`` (8), ``ranks`` (2), ``cores`` (2), ``gen_threads`` (1),
``train_threads`` (2), ``max_staleness`` (1), ``weight_sync_s`` (0: the trainer's publish + the generator's load
per version, wall seconds), ``p_long``, ``long_extra``, ``max_len`` (from ``bench.async_bench.WORKLOADS`` for a
known name, else 0, 0, 32), and ``async_generator_idle_frac``, ``async_trainer_idle_frac``,
``async_staleness_mean`` (shown next to the prediction when present).

Small-machine mode: sync = 2 ranks of 1 thread, each generating half the batch as one static batch (rlcore's
``static`` engine compacts finished rows, no refill), then training. The per-decode-step and per-row-token
seconds are fitted to the measured sync generation times of the workloads (two workloads with different
lengths: a 2x2 solve; one: half the time each); the training work is the measured sync update time x ranks
(core-seconds). Async = rlcore's configuration: 1 generator thread generating whole step batches and a trainer
of 2 threads sharing the 2 cores (processor sharing: 3 threads on 2 cores get 2/3 core each; one that waits
gives its share back), gate max_staleness 1. Only the sync numbers are fitted: the async samples/s and the
async/sync ratio are predictions, printed next to the measured ones. What the fit cannot know is the async
round's own per-step cost on the trainer's critical path (publish, the controller scoring the next batch, Ray
round trips): give it as ``weight_sync_s``, measured separately. On the run this was written against
(2 workloads; the overheads from the medians of rlcore's ``timing_s/*`` in the async CSVs): with 0 it predicts
async/sync 1.11 (default) and 1.17 (long-tail) against measured 0.99 and 0.98; with the measured publish (8 and
10 ms) 1.04 and 1.13; with the whole per-step time outside the update (16 and 42 ms) 0.98 and 1.01. The update
time under contention is predicted within 2-4% (0.110 s vs 0.112 measured, 0.262 vs 0.273); the generator's
idle share only on long-tail (0.34 vs 0.33; default 0.42 vs 0.58: there generation gets more than the 2/3 core
the model gives it).

Published numbers (reported; not reproduced here)
-------------------------------------------------
* AReaL (arXiv 2505.24298): reported up to 2.77x training speedup over synchronous systems with the same number
  of GPUs, math and code reasoning, matched or better final performance; it bounds staleness (its docs:
  ``max_head_offpolicyness``, 0 = synchronous, which they call typically 2x slower than asynchronous).
* ROLL Flash (arXiv 2510.11345): reported up to 2.24x on RLVR tasks and 2.72x on agentic tasks with the same GPU
  budget as synchronous baselines.
The script prints the same block with this model's speedups next to them.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections import deque
from dataclasses import asdict, dataclass, fields, replace
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np

GPUS = (8, 16, 32, 64)
STALENESS = (0, 1, 2, 4)


@dataclass(frozen=True)
class Costs:
    """Seconds on one GPU. Defaults: a ~7B dense model (Qwen2.5-7B-like: 28 layers, 4 KV heads x 128, bf16) on one
    H100-class GPU (3.35 TB/s HBM, ~990 dense bf16 TFLOP/s), vLLM/SGLang-style decoding, FSDP training."""

    # ~15 GB of bf16 weights read per decode step = 4.5 ms at peak bandwidth; with kernel launches, sampling and
    # scheduler overhead ~8 ms.
    t_tok_fixed: float = 8e-3
    # per row and step: its KV cache (57 KB/token, ~1-4k tokens of context -> 60-230 MB, 20-70 us) plus
    # 14 GFLOP/token of matmuls (~25 us at half of peak): ~60 us. At 256 rows a step is ~23 ms, ~11k tokens/s
    # per GPU, the order of what vLLM gets on one H100 for a 7B model with long outputs.
    t_tok_row: float = 6e-5
    # prefill: 14 GFLOP/token at ~550 TFLOP/s (compute bound).
    t_prefill_tok: float = 2.5e-5
    # training: policy forward+backward 6 x 7e9 = 42 GFLOP/token plus one forward for the old/proximal
    # log-probs 14 GFLOP = 56 GFLOP/token at ~45% MFU (445 TFLOP/s) -> 1.26e-4 s per token per GPU.
    t_train_per_token: float = 1.26e-4
    # per update: optimizer step and gradient reduce-scatter of 7B parameters, micro-batch imbalance.
    t_sync_fixed: float = 2.0
    # sync (colocated): hand the new weights to the inference engine on the same GPUs (reshard + load).
    t_reload: float = 2.0
    # async: broadcast 15 GB to the generator GPUs across nodes (~0.5 s at 25-50 GB/s) plus pausing, loading and
    # resuming the inference engines and their cache flush.
    t_weight_sync: float = 3.0
    pause_on_sync: bool = True  # generators stop decoding during the weight update (AReaL interrupts them)


@dataclass(frozen=True)
class Workload:
    prompts: int = 256  # B: prompts per training step
    n: int = 16  # responses per prompt (group size)
    prompt_len: int = 256
    short_median: float = 1000.0
    short_sigma: float = 0.6
    p_long: float = 0.1
    long_median: float = 6000.0
    long_sigma: float = 0.5
    max_len: int = 16384
    max_rows: int = 256  # concurrent rows per generating GPU (vLLM's default max_num_seqs is 256)

    @property
    def rows(self) -> int:
        return self.prompts * self.n


def sample_lengths(wl: Workload, groups: int, seed: int) -> np.ndarray:
    """Response lengths, shape (groups, n): every row independently short or (probability p_long) long. Group g's
    lengths depend only on (seed, g), not on ``groups``: a longer draw extends a shorter one."""
    u = np.random.default_rng(seed).random((groups, wl.n, 3))
    long = u[..., 0] < wl.p_long
    z = np.sqrt(-2.0 * np.log1p(-u[..., 1])) * np.cos(2.0 * np.pi * u[..., 2])  # Box-Muller: standard normal
    x = np.where(long, wl.long_median * np.exp(wl.long_sigma * z), wl.short_median * np.exp(wl.short_sigma * z))
    return np.clip(np.rint(x), 1, wl.max_len).astype(np.int64)


def mean_length(wl: Workload) -> float:
    """Expected response length (clipping ignored)."""
    return ((1 - wl.p_long) * wl.short_median * math.exp(wl.short_sigma ** 2 / 2)
            + wl.p_long * wl.long_median * math.exp(wl.long_sigma ** 2 / 2))


# ----------------------------------------------------------------------------------------------------- sync
def engine_seconds(lengths, c: Costs, max_rows: int, prompt_len: int) -> float:
    """One GPU generating ``lengths`` (all there at time 0, first come first served, at most ``max_rows`` at once,
    a finished row replaced by the next): prefill + decode steps x t_tok_fixed + tokens x t_tok_row (a row is
    active for exactly its length in steps, so the per-row term sums to its tokens)."""
    lengths = [int(x) for x in lengths]
    if not lengths:
        return 0.0
    if len(lengths) <= max_rows:
        steps = max(lengths)
    else:
        slots = lengths[:max_rows]
        heapq.heapify(slots)
        for x in lengths[max_rows:]:
            heapq.heapreplace(slots, slots[0] + x)
        steps = max(slots)
    return len(lengths) * prompt_len * c.t_prefill_tok + steps * c.t_tok_fixed + sum(lengths) * c.t_tok_row


def sync_step(lengths: np.ndarray, gpus: int, c: Costs, wl: Workload) -> dict:
    """One synchronous step on ``gpus`` GPUs for this step's response lengths (any shape; rows in order)."""
    rows = np.asarray(lengths).ravel()
    gen = max(engine_seconds(share, c, wl.max_rows, wl.prompt_len) for share in np.array_split(rows, gpus))
    train = c.t_train_per_token * (int(rows.sum()) + rows.size * wl.prompt_len) / gpus + c.t_sync_fixed
    return {"gen_s": gen, "train_s": train, "step_s": gen + train + c.t_reload}


def simulate_sync(gpus: int, wl: Workload, c: Costs, steps: int, seed: int) -> dict:
    """``steps`` synchronous steps on the first steps x B groups of ``sample_lengths(wl, ..., seed)``."""
    lengths = sample_lengths(wl, steps * wl.prompts, seed)
    per = [sync_step(lengths[k * wl.prompts:(k + 1) * wl.prompts], gpus, c, wl) for k in range(steps)]
    total = sum(p["step_s"] for p in per)
    return {"gpus": gpus, "samples_per_s": steps * wl.rows / total, "step_s": total / steps,
            "gen_s": sum(p["gen_s"] for p in per) / steps, "train_s": sum(p["train_s"] for p in per) / steps}


# ---------------------------------------------------------------------------------------------------- async
def simulate_async(gen_gpus: int, train_gpus: int, max_staleness: int, wl: Workload, c: Costs, steps: int,
                   warmup: int, seed: int, lengths: np.ndarray | None = None) -> dict:
    """The disaggregated run of ``steps`` training steps; rates over the steps after ``warmup``.

    Generators keep working (gated) past the last step, so the measured steps are all steady state; they use
    groups 0 .. (steps + s + 1) x B of ``sample_lengths(wl, ..., seed)`` (the synchronous run uses the first
    steps x B of them). Returns samples/s, generator idle fraction (GPU-time neither decoding nor prefilling,
    weight-sync pauses included), trainer idle fraction (time waiting for a complete batch), the staleness of
    every consumed group (``staleness``) and its mean/max over the measured steps."""
    if gen_gpus < 1 or train_gpus < 1:
        raise ValueError("need at least one generating and one training GPU")
    if not 0 <= warmup < steps:
        raise ValueError("need 0 <= warmup < steps")
    B, n, s = wl.prompts, wl.n, max_staleness
    total_groups = (steps + s + 1) * B
    if lengths is None:
        lengths = sample_lengths(wl, total_groups, seed)
    if len(lengths) < total_groups:
        raise ValueError(f"need lengths for {total_groups} groups")
    lens = lengths.tolist()
    batch_tokens = [int(lengths[k * B:(k + 1) * B].sum()) + B * n * wl.prompt_len for k in range(steps)]
    fixed, per_row, max_rows = c.t_tok_fixed, c.t_tok_row, wl.max_rows
    prefill_row = wl.prompt_len * c.t_prefill_tok
    G = gen_gpus

    # generator GPUs: heap of (finish position in decode steps, group), active rows, decode steps done at tref,
    # no decoding before `ready` (prefill, weight-sync pause), event epoch (stale events are skipped), busy s
    heaps: list[list] = [[] for _ in range(G)]
    nact = [0] * G
    pos = [0.0] * G
    tref = [0.0] * G
    ready = [0.0] * G
    epoch = [0] * G
    busy = [0.0] * G
    queue: deque = deque()  # rows handed out, not yet on a GPU: (group, length)
    g_vstart = [0] * total_groups
    g_left = [n] * total_groups
    batch_done = [0] * (steps + s + 1)
    st = {"v": 0, "started": 0}
    events: list = []
    seq = count()
    GEN, TRAIN_DONE, SYNC_DONE = 0, 1, 2

    def advance(i: int, now: float) -> None:
        if nact[i]:
            start = tref[i] if tref[i] > ready[i] else ready[i]
            if now > start:
                pos[i] += (now - start) / (fixed + per_row * nact[i])
                busy[i] += now - start
        tref[i] = now

    def schedule(i: int, now: float) -> None:
        epoch[i] += 1
        if nact[i]:
            wait = heaps[i][0][0] - pos[i]
            t = (now if now > ready[i] else ready[i]) + (wait if wait > 0 else 0.0) * (fixed + per_row * nact[i])
            heapq.heappush(events, (t, next(seq), GEN, i, epoch[i]))

    def next_row():
        if not queue:  # hand out the next group if the staleness gate allows it
            gi = st["started"]
            if gi >= total_groups or gi // B > st["v"] + s:
                return None
            st["started"] = gi + 1
            g_vstart[gi] = st["v"]
            queue.extend((gi, x) for x in lens[gi])
        return queue.popleft()

    def admitted(i: int, now: float, k: int) -> None:
        if k:
            ready[i] = (now if now > ready[i] else ready[i]) + k * prefill_row
            busy[i] += k * prefill_row

    def fill_all(now: float) -> None:
        """Give waiting rows to the least-loaded generators."""
        free = [(nact[i], i) for i in range(G) if nact[i] < max_rows]
        heapq.heapify(free)
        got = [0] * G
        while free:
            _, i = heapq.heappop(free)
            row = next_row()
            if row is None:
                break
            if not got[i]:
                advance(i, now)
            heapq.heappush(heaps[i], (pos[i] + row[1], row[0]))
            nact[i] += 1
            got[i] += 1
            if nact[i] < max_rows:
                heapq.heappush(free, (nact[i], i))
        for i in range(G):
            if got[i]:
                admitted(i, now, got[i])
                schedule(i, now)

    tr: dict[str, Any] = {"next": 0, "busy": False, "free_since": 0.0, "busy_s": 0.0}
    staleness: list[int] = []

    def try_train(now: float) -> None:
        k = tr["next"]
        if tr["busy"] or k >= steps or batch_done[k] < B:
            return
        v = st["v"]
        staleness.extend(v - g_vstart[gi] for gi in range(k * B, (k + 1) * B))
        dt = c.t_train_per_token * batch_tokens[k] / train_gpus + c.t_sync_fixed
        tr["busy"] = True
        tr["busy_s"] += dt + c.t_weight_sync
        heapq.heappush(events, (now + dt, next(seq), TRAIN_DONE, 0, 0))

    fill_all(0.0)
    snap = None
    now = 0.0
    while events:
        now, _, kind, i, ep = heapq.heappop(events)
        if kind == GEN:
            if ep != epoch[i]:
                continue
            advance(i, now)
            h, p, done = heaps[i], pos[i] + 1e-6, False
            while h and h[0][0] <= p:
                gi = heapq.heappop(h)[1]
                nact[i] -= 1
                g_left[gi] -= 1
                if not g_left[gi]:
                    b = gi // B
                    batch_done[b] += 1
                    done = done or (b == tr["next"] and batch_done[b] == B)
            k = 0
            while nact[i] < max_rows:
                row = next_row()
                if row is None:
                    break
                heapq.heappush(h, (pos[i] + row[1], row[0]))
                nact[i] += 1
                k += 1
            admitted(i, now, k)
            schedule(i, now)
            if done:
                try_train(now)
        elif kind == TRAIN_DONE:
            if c.pause_on_sync and c.t_weight_sync > 0:
                for j in range(G):
                    advance(j, now)
                    ready[j] = (now if now > ready[j] else ready[j]) + c.t_weight_sync
                    schedule(j, now)
            heapq.heappush(events, (now + c.t_weight_sync, next(seq), SYNC_DONE, 0, 0))
        else:  # SYNC_DONE: the new version is published
            st["v"] += 1
            tr["next"] += 1
            tr["busy"] = False
            tr["free_since"] = now
            if tr["next"] == warmup:
                for j in range(G):
                    advance(j, now)
                snap = (now, sum(busy), tr["busy_s"], len(staleness))
            if tr["next"] == steps:
                break
            fill_all(now)
            try_train(now)
    if tr["next"] < steps:
        raise RuntimeError("async simulation stalled")  # cannot happen: every handed-out row gets a GPU
    if snap is None:  # warmup == 0
        snap = (0.0, 0.0, 0.0, 0)
    for j in range(G):
        advance(j, now)
    t0, busy0, tbusy0, n0 = snap
    span = now - t0
    # the last step's busy time counted the weight sync that ends at `now`
    measured = staleness[n0:]
    return {"gen_gpus": gen_gpus, "train_gpus": train_gpus, "max_staleness": s,
            "samples_per_s": (steps - warmup) * wl.rows / span,
            "gen_idle": min(1.0, max(0.0, 1.0 - (sum(busy) - busy0) / (G * span))),
            "trainer_idle": min(1.0, max(0.0, 1.0 - (tr["busy_s"] - tbusy0) / span)),
            "staleness_mean": float(np.mean(measured)), "staleness_max": int(max(staleness)),
            "staleness": staleness, "time_s": now}


def balanced_split(gpus: int, wl: Workload, c: Costs) -> int:
    """Generating GPUs that balance saturated generation throughput against training (the search's start)."""
    mean = mean_length(wl)
    gen_rate = wl.max_rows / (c.t_tok_fixed + c.t_tok_row * wl.max_rows) / mean  # rows/s per GPU
    gen_rate = 1.0 / (1.0 / gen_rate + wl.prompt_len * c.t_prefill_tok / wl.max_rows)
    tokens = wl.rows * (mean + wl.prompt_len)

    def step(g: int) -> float:
        return max(wl.rows / (g * gen_rate), c.t_train_per_token * tokens / (gpus - g) + c.t_sync_fixed
                   + c.t_weight_sync)

    return min(range(1, gpus), key=step)


def search_split(gpus: int, max_staleness: int, wl: Workload, c: Costs, steps: int, warmup: int, seed: int,
                 lengths: np.ndarray | None = None, extra: tuple[int, ...] = ()) -> tuple[dict, list[dict]]:
    """Best split: all splits for G <= 8; else a grid of step G//8, the balanced split +-2 and the fixed ratio,
    then hill-climbing by one GPU from the best while it improves (throughput is not unimodal in the split: more
    generating GPUs also means fewer rows each, so faster decode steps and a shorter tail)."""
    if lengths is None:
        lengths = sample_lengths(wl, (steps + max_staleness + 1) * wl.prompts, seed)
    tried: dict[int, dict] = {}

    def run(g: int) -> dict:
        if g not in tried:
            tried[g] = simulate_async(g, gpus - g, max_staleness, wl, c, steps, warmup, seed, lengths)
        return tried[g]

    if gpus <= 8:
        for g in range(1, gpus):
            run(g)
    else:
        g0 = balanced_split(gpus, wl, c)
        for g in {*range(gpus // 8, gpus, gpus // 8), *range(max(1, g0 - 2), min(gpus - 1, g0 + 2) + 1),
                  *extra}:
            if 1 <= g < gpus:
                run(g)
        while True:
            top = max(tried, key=lambda g: tried[g]["samples_per_s"])
            nxt = [g for g in (top - 1, top + 1) if 1 <= g < gpus and g not in tried]
            if not nxt:
                break
            for g in nxt:
                run(g)
    best = max(tried.values(), key=lambda r: r["samples_per_s"])
    return best, [tried[g] for g in sorted(tried)]


def scale_rows(gpu_list, staleness_list, wl: Workload, c: Costs, steps: int, warmup: int, seed: int,
               split_ratio: float) -> list[dict]:
    rows = []
    lengths = sample_lengths(wl, (steps + max(staleness_list) + 1) * wl.prompts, seed)
    for G in gpu_list:
        sync = simulate_sync(G, wl, c, steps, seed)
        fixed_g = min(G - 1, max(1, round(G * split_ratio)))
        for s in staleness_list:
            best, tried = search_split(G, s, wl, c, steps, warmup, seed, lengths, extra=(fixed_g,))
            fixed = next(r for r in tried if r["gen_gpus"] == fixed_g)
            rows.append({"gpus": G, "max_staleness": s, "sync_samples_per_s": sync["samples_per_s"],
                         "sync_gen_s": sync["gen_s"], "sync_train_s": sync["train_s"],
                         "async_samples_per_s": best["samples_per_s"], "gen_gpus": best["gen_gpus"],
                         "train_gpus": best["train_gpus"], "speedup": best["samples_per_s"] / sync["samples_per_s"],
                         "gen_idle": best["gen_idle"], "trainer_idle": best["trainer_idle"],
                         "staleness_mean": best["staleness_mean"], "staleness_max": best["staleness_max"],
                         "fixed_gen_gpus": fixed_g, "fixed_samples_per_s": fixed["samples_per_s"],
                         "fixed_speedup": fixed["samples_per_s"] / sync["samples_per_s"]})
    return rows


# ------------------------------------------------------------------------------------------- small machine
# bench/async_bench.py's long-tailed workload (used when the calibration names it without p_long/long_extra)
_FALLBACK_WORKLOADS = {"default": {}, "long-tail": {"task.long_tail_frac": 0.125, "task.long_tail_length": 24,
                                                    "task.max_response_length": 32}}


def _bench_workloads() -> dict:
    try:
        from bench.async_bench import WORKLOADS
        return WORKLOADS
    except Exception:  # noqa: BLE001 - the bench's imports need the full environment; the copy above suffices
        return _FALLBACK_WORKLOADS


def small_lengths(sec: dict, rows: int, steps: int, seed: int) -> np.ndarray:
    """Small-task answer lengths (tokens = characters): short = 1 + Poisson(mean_short - 1), long = short +
    long_extra with probability p_long, clipped to max_len; shape (steps, rows)."""
    rng = np.random.default_rng(seed)
    m_short = max(1.0, sec["mean_response_length"] - sec["p_long"] * sec["long_extra"])
    x = 1 + rng.poisson(m_short - 1, (steps, rows))
    x = x + np.where(rng.random((steps, rows)) < sec["p_long"], sec["long_extra"], 0)
    return np.clip(x, 1, sec["max_len"])


def _small_sections(calib: dict) -> dict[str, dict]:
    known = _bench_workloads()
    out = {}
    for name, sec in calib.items():
        if not (isinstance(sec, dict) and "sync_gen_s" in sec):
            continue
        wl = known.get(name, {})
        d = {"n": 8, "ranks": 2, "cores": 2, "gen_threads": 1, "train_threads": 2, "max_staleness": 1,
             "weight_sync_s": 0.0, "p_long": wl.get("task.long_tail_frac", 0.0),
             "long_extra": wl.get("task.long_tail_length", 0), "max_len": wl.get("task.max_response_length", 32)}
        d.update(sec)
        out[name] = d
    return out


def fit_small(sections: dict[str, dict], seed: int, steps: int = 200) -> tuple[float, float, str]:
    """Per-decode-step and per-row-token seconds (one thread) from the measured sync generation times."""
    feats, ys = [], []
    for sec in sections.values():
        rows, ranks = int(sec["samples_per_step"]), int(sec["ranks"])
        L = small_lengths(sec, rows, steps, seed)
        shares = np.array_split(L, ranks, axis=1)
        feats.append([np.mean(np.max([sh.max(axis=1) for sh in shares], axis=0)),
                      np.mean(np.max([sh.sum(axis=1) for sh in shares], axis=0))])
        ys.append(sec["sync_gen_s"])
    A, y = np.array(feats, float), np.array(ys, float)
    if len(ys) >= 2 and np.linalg.matrix_rank(A) == 2:
        (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
        if a > 0 and b > 0:
            return float(a), float(b), "fitted to the workloads' sync generation times"
    a, b = 0.5 * y[0] / A[0, 0], 0.5 * y[0] / A[0, 1]
    return float(a), float(b), "one workload (or no positive fit): half of its sync generation time each"


def small_async(gen_work: list[float], train_work: float, wall_s: float, sec: dict, steps: int,
                warmup: int) -> dict:
    """rlcore's async round on shared cores: one generator (``gen_threads``) generating whole batches in order,
    the trainer (``train_threads``) training them; processor sharing of ``cores``; batch j handed out once
    version >= j - s; after each update ``wall_s`` of trainer wall time (controller, publish) without CPU. The
    generator goes on past the last step (``gen_work`` needs steps + s + 1 batches): all measured steps are
    steady state."""
    if len(gen_work) < steps + int(sec["max_staleness"]) + 1:
        raise ValueError("gen_work needs steps + max_staleness + 1 batches")
    C, tg, tt, s = sec["cores"], sec["gen_threads"], sec["train_threads"], int(sec["max_staleness"])
    t, v = 0.0, 0
    gen_j, gen_rem, gen_v = 0, None, 0  # next batch to generate / work left of the current one
    done: dict[int, int] = {}  # generated batch -> version it was generated with
    k, phase, rem = 0, None, 0.0  # trainer: next step, "work" | "wall" | None
    gen_busy = train_wait = update = 0.0
    stale: list[int] = []
    snap = None
    while k < steps:
        if gen_rem is None and gen_j < len(gen_work) and gen_j <= v + s:
            gen_rem, gen_v = gen_work[gen_j], v
        if phase is None and k in done:
            phase, rem = "work", train_work
            stale.append(v - done.pop(k))
        both = gen_rem is not None and phase == "work"
        rg = min(tg, C * tg / (tg + tt)) if both else min(tg, C)
        rt = min(tt, C * tt / (tg + tt)) if both else min(tt, C)
        dts = []
        if gen_rem is not None:
            dts.append(gen_rem / rg)
        if phase is not None:
            dts.append(rem / (rt if phase == "work" else 1.0))
        dt = min(dts)
        if gen_rem is not None:
            gen_rem -= dt * rg
            gen_busy += dt
        if phase is None:
            train_wait += dt
        elif phase == "work":
            update += dt
            rem -= dt * rt
        else:
            rem -= dt
        t += dt
        if gen_rem is not None and gen_rem <= 1e-12:
            done[gen_j] = gen_v
            gen_j, gen_rem = gen_j + 1, None
        if phase is not None and rem <= 1e-12:
            if phase == "work" and wall_s > 0:
                phase, rem = "wall", wall_s
            else:
                phase, v, k = None, v + 1, k + 1
                if k == warmup:
                    snap = (t, gen_busy, train_wait, update, len(stale))
    t0, gb0, tw0, up0, n0 = snap or (0.0, 0.0, 0.0, 0.0, 0)
    span = t - t0
    return {"step_s": span / (steps - warmup), "update_s": (update - up0) / (steps - warmup),
            "gen_idle": 1 - (gen_busy - gb0) / span,
            "trainer_idle": (train_wait - tw0) / span, "staleness_mean": float(np.mean(stale[n0:])),
            "staleness_max": int(max(stale))}


def small_machine(calib: dict, seed: int, steps: int = 150, warmup: int = 1) -> dict:
    sections = _small_sections(calib)
    if not sections:
        return {}
    a, b, how = fit_small(sections, seed)
    out: dict[str, Any] = {"gen_s_per_decode_step": a, "gen_s_per_row_token": b, "fit": how, "workloads": []}
    for name, sec in sections.items():
        rows, ranks = int(sec["samples_per_step"]), int(sec["ranks"])
        L = small_lengths(sec, rows, steps + int(sec["max_staleness"]) + 1, seed + 1)
        other = max(0.0, sec["sync_step_s"] - sec["sync_gen_s"] - sec["sync_update_s"])  # controller, scoring
        sync_gen = [max(a * sh.max() + b * sh.sum() for sh in np.array_split(r, ranks)) for r in L]
        sync_step = float(np.mean(sync_gen)) + sec["sync_update_s"] + other
        gen_work = [a * r.max() + b * r.sum() for r in L]  # one thread, the whole batch
        res = small_async(gen_work, ranks * sec["sync_update_s"], other + sec["weight_sync_s"], sec, steps, warmup)
        pred = sync_step / res["step_s"]
        row = {"workload": name, "samples_per_step": rows,
               "sim_sync_samples_per_s": rows / sync_step, "measured_sync_samples_per_s": sec["sync_samples_per_s"],
               "sim_async_samples_per_s": rows / res["step_s"],
               "measured_async_samples_per_s": sec["async_samples_per_s"],
               "sim_async_over_sync": pred, "measured_async_over_sync": sec["measured_async_over_sync"],
               "sim_update_s": res["update_s"], "measured_sync_update_s": sec["sync_update_s"],
               "sim_gen_idle": res["gen_idle"], "sim_trainer_idle": res["trainer_idle"],
               "sim_staleness_mean": res["staleness_mean"], "weight_sync_s": sec["weight_sync_s"]}
        for key in ("async_generator_idle_frac", "async_trainer_idle_frac", "async_staleness_mean"):
            if key in sec:
                row["measured_" + key.removeprefix("async_")] = sec[key]
        out["workloads"].append(row)
    return out


# ------------------------------------------------------------------------------------------------- report
PUBLISHED = [
    "AReaL (arXiv 2505.24298): reported up to 2.77x training speedup over synchronous systems with the same number "
    "of GPUs (math and code reasoning), with bounded staleness (max_head_offpolicyness; 0 = synchronous).",
    "ROLL Flash (arXiv 2510.11345): reported up to 2.24x on RLVR tasks and 2.72x on agentic tasks with the same "
    "GPU budget as synchronous baselines.",
]


def fmt_table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(x) for x in r] for r in rows]
    w = [max(len(r[j]) for r in cells) for j in range(len(header))]
    line = lambda r: "  ".join(x.rjust(w[j]) for j, x in enumerate(r))  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * x for x in w)] + [line(r) for r in cells[1:]])


def scale_table(rows: list[dict]) -> str:
    return fmt_table(
        ["G", "s", "sync/s", "async/s", "gen:train", "speedup", "50/50 async/s", "50/50 x", "gen idle",
         "train idle", "stale mean"],
        [[r["gpus"], r["max_staleness"], f"{r['sync_samples_per_s']:.2f}", f"{r['async_samples_per_s']:.2f}",
          f"{r['gen_gpus']}:{r['train_gpus']}", f"{r['speedup']:.2f}x", f"{r['fixed_samples_per_s']:.2f}",
          f"{r['fixed_speedup']:.2f}x", f"{r['gen_idle']:.2f}", f"{r['trainer_idle']:.2f}",
          f"{r['staleness_mean']:.2f}"] for r in rows])


def small_table(small: dict) -> str:
    rows = []
    for r in small["workloads"]:
        rows.append([r["workload"], f"{r['sim_sync_samples_per_s']:.0f} / {r['measured_sync_samples_per_s']:.0f}",
                     f"{r['sim_async_samples_per_s']:.0f} / {r['measured_async_samples_per_s']:.0f}",
                     f"{r['sim_async_over_sync']:.2f} / {r['measured_async_over_sync']:.2f}",
                     f"{r['sim_gen_idle']:.2f}" + (f" / {r['measured_generator_idle_frac']:.2f}"
                                                   if "measured_generator_idle_frac" in r else ""),
                     f"{r['sim_trainer_idle']:.2f}" + (f" / {r['measured_trainer_idle_frac']:.2f}"
                                                       if "measured_trainer_idle_frac" in r else ""),
                     f"{r['sim_staleness_mean']:.2f}"])
    return fmt_table(["workload", "sync/s sim/meas", "async/s sim/meas", "async/sync sim/meas", "gen idle",
                      "train idle", "stale mean"], rows)


def comparison(rows: list[dict]) -> str:
    best = max(rows, key=lambda r: r["speedup"])
    lines = ["Published (reported, not reproduced):"] + [f"- {p}" for p in PUBLISHED]
    lines.append(f"- this simulation: {min(r['speedup'] for r in rows):.2f}x-{best['speedup']:.2f}x over the rows "
                 f"above (best {best['speedup']:.2f}x at G={best['gpus']}, s={best['max_staleness']}, split "
                 f"{best['gen_gpus']}:{best['train_gpus']}); a model of throughput only, with assumed 7B/H100 "
                 f"costs unless calibrated, not of convergence per sample.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- CLI
_COST_KEYS = {"gen_s_per_decode_step": "t_tok_fixed", "gen_s_per_row_token": "t_tok_row",
              "gen_s_per_prefill_token": "t_prefill_tok", "train_s_per_token": "t_train_per_token",
              "train_s_fixed": "t_sync_fixed", "reload_s": "t_reload", "weight_sync_s": "t_weight_sync"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.async_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d, c = Workload(), Costs()
    g = p.add_argument_group("run")
    g.add_argument("--gpus", default=",".join(map(str, GPUS)),
                   help="comma-separated total GPU counts (default %(default)s)")
    g.add_argument("--max-staleness", type=int, default=1,
                   help="max_staleness s of the main table (default %(default)s, rlcore's default)")
    g.add_argument("--staleness-sweep", default=",".join(map(str, STALENESS)),
                   help="s values of the sweep table (default %(default)s); empty: no sweep")
    g.add_argument("--sweep-gpus", type=int, default=32, help="G of the staleness sweep (default %(default)s)")
    g.add_argument("--split-ratio", type=float, default=0.5,
                   help="fixed share of generating GPUs reported next to the best split (default %(default)s)")
    g.add_argument("--steps", type=int, default=14, help="training steps simulated per run (default %(default)s)")
    g.add_argument("--warmup", type=int, default=4,
                   help="async steps excluded from the rates (pipeline filling; default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of the response lengths (default %(default)s)")
    g.add_argument("--calibration", metavar="FILE", help="JSON of measured numbers (see the description above)")
    g.add_argument("--mode", choices=("all", "scale", "small"), default="all",
                   help="scale: the 8-64 GPU tables; small: the 2-core machine check (needs --calibration); "
                        "all: both (the small one only with --calibration)")
    g.add_argument("--json", metavar="OUT", help="also write everything printed as JSON here")
    w = p.add_argument_group("workload")
    w.add_argument("--prompts", type=int, default=d.prompts, help="B, prompts per step (default %(default)s)")
    w.add_argument("--n", type=int, default=d.n, help="responses per prompt (default %(default)s)")
    w.add_argument("--prompt-len", type=int, default=d.prompt_len, help="prompt tokens (default %(default)s)")
    w.add_argument("--short-median", type=float, default=d.short_median,
                   help="median length of short responses, tokens (default %(default)s)")
    w.add_argument("--short-sigma", type=float, default=d.short_sigma,
                   help="lognormal sigma of short responses (default %(default)s)")
    w.add_argument("--p-long", type=float, default=d.p_long, help="share of long responses (default %(default)s)")
    w.add_argument("--long-median", type=float, default=d.long_median,
                   help="median length of long responses (default %(default)s)")
    w.add_argument("--long-sigma", type=float, default=d.long_sigma,
                   help="lognormal sigma of long responses (default %(default)s)")
    w.add_argument("--max-len", type=int, default=d.max_len, help="response length cap (default %(default)s)")
    w.add_argument("--max-rows", type=int, default=d.max_rows,
                   help="concurrent rows per generating GPU (default %(default)s)")
    k = p.add_argument_group("costs (seconds on one GPU; defaults: ~7B model on an H100-class GPU, or the "
                             "calibration's top-level keys)")
    k.add_argument("--t-tok-fixed", type=float, help=f"per decode step (default {c.t_tok_fixed:g})")
    k.add_argument("--t-tok-row", type=float, help=f"per decode step and active row (default {c.t_tok_row:g})")
    k.add_argument("--t-prefill-tok", type=float, help=f"per prompt token (default {c.t_prefill_tok:g})")
    k.add_argument("--t-train-per-token", type=float,
                   help=f"training per token, prompt + response (default {c.t_train_per_token:g})")
    k.add_argument("--t-sync-fixed", type=float, help=f"per update, fixed (default {c.t_sync_fixed:g})")
    k.add_argument("--t-reload", type=float, help=f"sync: weight reload per step (default {c.t_reload:g})")
    k.add_argument("--t-weight-sync", type=float,
                   help=f"async: weight update/broadcast per version (default {c.t_weight_sync:g})")
    k.add_argument("--no-pause-on-sync", action="store_true",
                   help="async generators keep decoding during the weight update (default: they pause)")
    return p


def costs_from(args, calib: dict) -> Costs:
    c = Costs()
    over = {attr: float(calib[key]) for key, attr in _COST_KEYS.items() if isinstance(calib.get(key), (int, float))}
    over.update({f.name: getattr(args, f.name) for f in fields(Costs)
                 if f.name != "pause_on_sync" and getattr(args, f.name, None) is not None})
    return replace(c, **over, pause_on_sync=not args.no_pause_on_sync)


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    calib = json.loads(Path(args.calibration).read_text()) if args.calibration else {}
    if args.mode == "small" and not args.calibration:
        raise SystemExit("--mode small needs --calibration FILE")
    c = costs_from(args, calib)
    wl = Workload(args.prompts, args.n, args.prompt_len, args.short_median, args.short_sigma, args.p_long,
                  args.long_median, args.long_sigma, args.max_len, args.max_rows)
    out: dict = {"costs": asdict(c), "workload": asdict(wl), "mean_response_length": mean_length(wl),
                 "steps": args.steps, "warmup": args.warmup, "seed": args.seed}
    if args.mode in ("all", "scale"):
        gpus = [int(x) for x in args.gpus.split(",") if x]
        print(f"Workload: {wl.prompts} prompts x {wl.n} = {wl.rows} samples/step, mean response ~{mean_length(wl):.0f} "
              f"tokens (p_long {wl.p_long}, cap {wl.max_len}); costs: {asdict(c)}", flush=True)
        main_rows = scale_rows(gpus, [args.max_staleness], wl, c, args.steps, args.warmup, args.seed,
                               args.split_ratio)
        print(f"\nSync vs async (best split searched; 50/50 = --split-ratio {args.split_ratio}), "
              f"max_staleness {args.max_staleness}, samples/s:\n" + scale_table(main_rows), flush=True)
        out["scale"] = main_rows
        sweep = [int(x) for x in args.staleness_sweep.split(",") if x]
        rows = main_rows
        if sweep:
            sweep_rows = scale_rows([args.sweep_gpus], sweep, wl, c, args.steps, args.warmup, args.seed,
                                    args.split_ratio)
            print(f"\nmax_staleness sweep at G={args.sweep_gpus}:\n" + scale_table(sweep_rows), flush=True)
            out["staleness_sweep"] = sweep_rows
            rows = main_rows + sweep_rows
        text = comparison(rows)
        print("\n" + text)
        out["published"] = PUBLISHED
    if args.mode in ("all", "small") and args.calibration:
        small = small_machine(calib, args.seed)
        if small:
            print(f"\nSmall machine ({args.calibration}; {small['fit']}: {small['gen_s_per_decode_step']:.2e} s per "
                  f"decode step, {small['gen_s_per_row_token']:.2e} s per row-token), simulated / measured:\n"
                  + small_table(small))
            out["small_machine"] = small
        else:
            print(f"\n{args.calibration}: no workload sections (sync_gen_s ...), no small-machine check")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
