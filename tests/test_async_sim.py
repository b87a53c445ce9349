"""bench.async_sim: the sync/async discrete-event simulation, checked against hand-computed values and properties."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.async_sim import (Costs, Workload, engine_seconds, main, sample_lengths, search_split, simulate_async,
                             simulate_sync, small_async, sync_step)

# Round numbers so every expected value below is worked out by hand.
HAND = Costs(t_tok_fixed=0.01, t_tok_row=0.001, t_prefill_tok=0.001, t_train_per_token=0.001, t_sync_fixed=0.5,
             t_reload=0.3, t_weight_sync=0.3)
# all responses exactly 100 tokens: lognormal with sigma 0 is its median, no long ones
EQUAL = Workload(prompts=8, n=4, prompt_len=10, short_median=100, short_sigma=0.0, p_long=0.0, max_len=1000,
                 max_rows=64)


def tail(p_long: float) -> Workload:
    return Workload(prompts=16, n=8, prompt_len=64, short_median=300, short_sigma=0.3, p_long=p_long,
                    long_median=3000, long_sigma=0.3, max_len=4096, max_rows=64)


def test_lengths_equal_and_deterministic():
    assert (sample_lengths(EQUAL, 5, seed=3) == 100).all()
    a, b = sample_lengths(tail(0.1), 50, seed=7), sample_lengths(tail(0.1), 50, seed=7)
    assert (a == b).all() and not (a == sample_lengths(tail(0.1), 50, seed=8)).all()
    assert a.min() >= 1 and a.max() <= 4096


def test_sync_step_hand_computed():
    """2 GPUs, rows [2, 5 | 3, 3]; t_fixed 1, t_row 0.1, prefill 0.25/token x 2 prompt tokens = 0.5 per row.
    GPU0: 2 x 0.5 + 5 decode steps x 1 + 7 tokens x 0.1 = 6.7; GPU1: 1.0 + 3 + 0.6 = 4.6 -> gen 6.7.
    train: 0.01 x (13 response + 4 x 2 prompt tokens) / 2 GPUs + 0.5 = 0.605; reload 0.25 -> step 7.555."""
    c = Costs(t_tok_fixed=1.0, t_tok_row=0.1, t_prefill_tok=0.25, t_train_per_token=0.01, t_sync_fixed=0.5,
              t_reload=0.25)
    wl = Workload(prompts=2, n=2, prompt_len=2, max_rows=8)
    r = sync_step(np.array([[2, 5], [3, 3]]), 2, c, wl)
    assert r["gen_s"] == pytest.approx(6.7)
    assert r["train_s"] == pytest.approx(0.605)
    assert r["step_s"] == pytest.approx(7.555)


def test_engine_refills_slots_first_come_first_served():
    """1 GPU, 2 slots, rows [4, 1, 1, 3]: slot 2 runs the 1-token rows at steps 1 and 2, then the 3-token row in
    steps 3-5; slot 1 runs the 4-token row -> 5 decode steps, 9 row-steps: 5 x 1 + 9 x 0.1 = 5.9."""
    c = Costs(t_tok_fixed=1.0, t_tok_row=0.1, t_prefill_tok=0.0)
    assert engine_seconds([4, 1, 1, 3], c, max_rows=2, prompt_len=5) == pytest.approx(5.9)
    assert engine_seconds([4, 1, 1, 3], c, max_rows=4, prompt_len=5) == pytest.approx(4 + 0.9)


def test_equal_lengths_no_staleness_async_not_faster():
    """max_staleness 0 cannot overlap generation and training, so with no tail to hide async is never faster.
    Hand values: 32 rows of 100 tokens + 10 prompt tokens each.
    sync, 2 GPUs: gen = 16 x 10 x 0.001 + 100 x 0.01 + 1600 x 0.001 = 2.76; train = 3520 x 0.001 / 2 + 0.5 =
    2.26; + reload 0.3 -> 5.32 s per 32 samples.
    async 1+1: gen = 0.32 + 1.0 + 3.2 = 4.52; train = 3.52 + 0.5 = 4.02; + weight sync 0.3 -> 8.84 s."""
    sync = simulate_sync(2, EQUAL, HAND, steps=4, seed=0)
    assert sync["samples_per_s"] == pytest.approx(32 / 5.32)
    a = simulate_async(1, 1, 0, EQUAL, HAND, steps=4, warmup=1, seed=0)
    assert a["samples_per_s"] == pytest.approx(32 / 8.84)
    assert a["staleness_mean"] == 0.0
    # generators idle while the trainer trains and publishes: 1 - 4.52 / 8.84; trainer waits 4.52 / 8.84
    assert a["gen_idle"] == pytest.approx(1 - 4.52 / 8.84)
    assert a["trainer_idle"] == pytest.approx(4.52 / 8.84)
    for G in (2, 4, 8):
        sync = simulate_sync(G, EQUAL, HAND, steps=4, seed=0)
        for g in range(1, G):
            r = simulate_async(g, G - g, 0, EQUAL, HAND, steps=4, warmup=1, seed=0)
            assert r["samples_per_s"] <= sync["samples_per_s"] * (1 + 1e-9), (G, g)


def test_long_tail_async_beats_sync_and_gain_grows_with_tail():
    """Checks of properties (G = 8, every split tried, mean over 3 seeds): with long responses and
    max_staleness >= 1 async beats sync, and its advantage grows with the share of long responses."""
    c = Costs()
    for s in (1, 2):
        ratios = []
        for p in (0.0, 0.03, 0.1):
            per_seed = []
            for seed in range(3):
                sync = simulate_sync(8, tail(p), c, steps=12, seed=seed)
                best, _ = search_split(8, s, tail(p), c, steps=12, warmup=3, seed=seed)
                per_seed.append(best["samples_per_s"] / sync["samples_per_s"])
                if p > 0:
                    assert per_seed[-1] > 1.0, (s, p, seed)
            ratios.append(float(np.mean(per_seed)))
        assert ratios[0] < ratios[1] < ratios[2], (s, ratios)


@pytest.mark.parametrize("s", [0, 1, 2, 4])
def test_staleness_never_exceeds_max(s):
    """Every group of every step is consumed once, none more than s versions old; with generation the
    bottleneck (2 of 8 GPUs generate) the bound is reached, so the check is not vacuous."""
    wl = tail(0.1)
    for g in (2, 4, 6):
        r = simulate_async(g, 8 - g, s, wl, Costs(), steps=10, warmup=3, seed=0)
        st = r["staleness"]
        assert len(st) == 10 * wl.prompts
        assert min(st) >= 0 and max(st) <= s and r["staleness_max"] <= s
    assert simulate_async(2, 6, s, wl, Costs(), steps=10, warmup=3, seed=0)["staleness_max"] == s


def test_small_machine_processor_sharing_hand_computed():
    """2 cores, 1 generator thread + 2 trainer threads, s = 1, generation 0.3 core-s per batch, training 0.6
    core-s per step. Steady state: both run, 2/3 and 4/3 core: the batch takes 0.45 s, the trainer does 0.6 of
    work in that time: exactly one step of 0.45 s, generator never idle, trainer never waits."""
    sec = {"cores": 2, "gen_threads": 1, "train_threads": 2, "max_staleness": 1}
    r = small_async([0.3] * 25, 0.6, 0.0, sec, steps=20, warmup=2)
    assert r["step_s"] == pytest.approx(0.45)
    assert r["gen_idle"] == pytest.approx(0.0, abs=1e-9) and r["trainer_idle"] == pytest.approx(0.0, abs=1e-9)
    assert r["staleness_mean"] == pytest.approx(1.0)
    # training 1.2 core-s: both run for 0.45 s (generator done, trainer did 0.6), then the trainer alone at 2 cores
    # for 0.3 s -> 0.75 s a step; the generator (1 batch ahead, gate) idles 0.3 of 0.75
    r = small_async([0.3] * 25, 1.2, 0.0, sec, steps=20, warmup=2)
    assert r["step_s"] == pytest.approx(0.75)
    assert r["gen_idle"] == pytest.approx(0.4)


def test_cli_json_and_small_mode(tmp_path, capsys):
    calib = {"default": {"samples_per_step": 64, "sync_gen_s": 0.04, "sync_update_s": 0.08, "sync_step_s": 0.12,
                         "mean_response_length": 3.3, "sync_samples_per_s": 533.0, "async_samples_per_s": 520.0,
                         "measured_async_over_sync": 0.975}}
    (tmp_path / "c.json").write_text(json.dumps(calib))
    out = tmp_path / "o.json"
    main(["--gpus", "8", "--staleness-sweep", "0,1", "--sweep-gpus", "8", "--prompts", "8", "--n", "4",
          "--steps", "5", "--warmup", "2", "--max-len", "2048", "--calibration", str(tmp_path / "c.json"),
          "--json", str(out)])
    got = json.loads(out.read_text())
    assert [r["gpus"] for r in got["scale"]] == [8]
    assert [r["max_staleness"] for r in got["staleness_sweep"]] == [0, 1]
    row = got["scale"][0]
    assert row["gen_gpus"] + row["train_gpus"] == 8
    assert row["speedup"] == pytest.approx(row["async_samples_per_s"] / row["sync_samples_per_s"])
    small = got["small_machine"]["workloads"][0]
    assert small["measured_async_over_sync"] == 0.975 and small["sim_async_over_sync"] > 0
    printed = capsys.readouterr().out
    assert "reported up to 2.77x" in printed and "2.24x" in printed and "2.72x" in printed
