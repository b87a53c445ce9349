"""Rows that generate turn by turn (rlcore.rollout.turns): the static engine continues each row from its own KV
cache slot (only the observation is prefilled) and gives the same tokens and log-probs as the HF engine and as
full uncached forwards over each trajectory, greedy and sampled, while rows finish, wait and resume at different
steps (so the static engine compacts its slots mid-call)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlcore.rollout.base import SamplingParams
from rlcore.rollout.hf import HFRolloutEngine
from rlcore.rollout.static import StaticRolloutEngine
from tests.engine.test_static_engine import PAD, common_token, left_padded, llama  # noqa: F401 - the fixture

BUDGET = 40
OBS = [9, 10, 11, 12]


def drive(engine, ids, mask, params, seed=5):
    """Three turns at most; row r's k-th observation is OBS[:1 + (r + k) % 4] while it fits."""
    t = engine.open_rows(ids, mask, params, budget=BUDGET, generator=torch.Generator().manual_seed(seed))
    turns = [0] * len(t)
    while t.active():
        for r in t.step():
            turns[r] += 1
            obs = OBS[: 1 + (r + turns[r]) % 4]
            if turns[r] < 3 and t.stopped_at_eos(r) and t.room(r) > len(obs):
                t.append(r, obs)
            else:
                t.finish(r)
    return t.result(), turns


@torch.no_grad()
def uncached_log_probs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log p of each response token from one plain forward over prompt + response."""
    seq = torch.tensor([prompt + response])
    logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].float() / temperature
    return F.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=BUDGET, greedy=True),
                                    SamplingParams(max_new_tokens=BUDGET, temperature=1.3, top_k=20)],
                         ids=["greedy", "sampled"])
def test_static_rows_equal_the_hf_engine_and_uncached_forwards(llama, params):
    ids, mask = left_padded(llama.config.vocab_size, [3, 7, 5, 1, 6], repeat=3)
    eos = common_token(llama, ids, mask)
    static = StaticRolloutEngine(llama, eos_token_id=eos, pad_token_id=PAD)
    got, turns = drive(static, ids, mask, params)
    want, _ = drive(HFRolloutEngine(llama, eos_token_id=eos, pad_token_id=PAD), ids, mask, params)
    assert torch.equal(got["responses"], want["responses"])
    for key in ("response_mask", "attention"):
        assert torch.equal(got[key], want[key])
    torch.testing.assert_close(got["log_probs"], want["log_probs"], atol=1e-5, rtol=0)
    assert max(turns) >= 2 and static.stats["extends"] >= 1  # rows were continued after observations
    for i in range(len(ids)):
        n = int(got["attention"][i].sum())
        response, model_tokens = got["responses"][i, :n].tolist(), got["response_mask"][i, :n].bool()
        ref = uncached_log_probs(llama, ids[i][mask[i].bool()].tolist(), response, params.temperature)
        torch.testing.assert_close(got["log_probs"][i, :n][model_tokens], ref[model_tokens], atol=1e-4, rtol=0)
        observed = ~model_tokens
        assert got["log_probs"][i, :n][observed].eq(0).all()


@torch.no_grad()
def test_greedy_rows_pick_the_argmax_of_an_uncached_forward_after_each_observation(llama):
    ids, mask = left_padded(llama.config.vocab_size, [4, 2, 6], repeat=2, seed=3)
    eos = common_token(llama, ids, mask)
    got, _ = drive(StaticRolloutEngine(llama, eos_token_id=eos, pad_token_id=PAD), ids, mask,
                   SamplingParams(max_new_tokens=BUDGET, greedy=True))
    checked = 0
    for i in range(len(ids)):
        prompt = ids[i][mask[i].bool()].tolist()
        n = int(got["attention"][i].sum())
        seq = prompt + got["responses"][i, :n].tolist()
        argmax = llama(input_ids=torch.tensor([seq])).logits[0, len(prompt) - 1:-1].argmax(-1)
        model_tokens = got["response_mask"][i, :n].bool()
        assert torch.equal(argmax[model_tokens], got["responses"][i, :n][model_tokens])
        checked += int((~model_tokens).sum() > 0)
    assert checked >= 2  # rows with observations were checked


def test_an_observation_that_leaves_no_room_is_refused(llama):
    ids, mask = left_padded(llama.config.vocab_size, [3], repeat=1)
    t = StaticRolloutEngine(llama, eos_token_id=-1, pad_token_id=PAD).open_rows(
        ids, mask, SamplingParams(max_new_tokens=4, greedy=True), budget=4)
    assert t.step() == []
    with pytest.raises(ValueError, match="not waiting"):
        t.append(0, [5])
    t.state[0] = 1  # as if its turn had ended
    with pytest.raises(ValueError, match="leave no room"):
        t.append(0, [5, 6, 7])  # 1 token + 3 = the whole budget: nothing left for the model


def drive_delayed(engine, ids, mask, delays, deterministic):
    """As :func:`drive`, each row's observations handed back ``delays[r]`` steps after its turn ended (a tool that
    takes that long), sampled."""
    t = engine.open_rows(ids, mask, SamplingParams(max_new_tokens=BUDGET, temperature=1.0), budget=BUDGET,
                         generator=torch.Generator().manual_seed(9), deterministic=deterministic)
    turns, due, step = [0] * len(t), {}, 0
    while t.active():
        for r in t.step():
            turns[r] += 1
            obs = OBS[: 1 + (r + turns[r]) % 4]
            if turns[r] < 3 and t.stopped_at_eos(r) and t.room(r) > len(obs):
                due[r] = (step + delays[r], obs)
            else:
                t.finish(r)
        for r, (when, obs) in list(due.items()):
            if step >= when:
                t.append(r, obs)
                del due[r]
        step = step + 1 if t.running() or not due else min(w for w, _ in due.values())
    return t.result()


def test_deterministic_rows_do_not_depend_on_when_tools_answer(llama):
    ids, mask = left_padded(llama.config.vocab_size, [3, 7, 5, 1, 6], repeat=3)
    eos = common_token(llama, ids, mask)
    engine = StaticRolloutEngine(llama, eos_token_id=eos, pad_token_id=PAD)
    prompt_now = drive_delayed(engine, ids, mask, [0] * len(ids), deterministic=True)
    late = drive_delayed(engine, ids, mask, [(5 * r) % 7 for r in range(len(ids))], deterministic=True)
    assert int((prompt_now["attention"] - prompt_now["response_mask"]).sum()) > 0  # observations were fed
    for key in ("responses", "response_mask", "attention", "log_probs"):
        assert torch.equal(prompt_now[key], late[key]), key  # bit for bit
    assert engine.stats["extends"] == 0  # observations went through the decode steps
    fast = drive_delayed(engine, ids, mask, [0] * len(ids), deterministic=False)
    assert torch.equal(fast["responses"], prompt_now["responses"])  # the same trajectories, by the faster path
    torch.testing.assert_close(fast["log_probs"], prompt_now["log_probs"], atol=1e-5, rtol=0)


def test_an_extend_over_contiguous_slots_equals_one_over_scattered_slots(llama):
    # the same rows' caches in slots 1..p (attended to as a view) and shuffled across slots 0..p (gathered)
    decoder = StaticRolloutEngine(llama, eos_token_id=-1, pad_token_id=PAD).decoder
    p, length = 6, 40
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = decoder.new_cache(p + 1, length)
    k_moved, v_moved = decoder.new_cache(p + 1, length)
    for c in k_cache + v_cache + k_moved + v_moved:
        c.copy_(torch.randn(c.shape, generator=g))
    perm = torch.tensor([3, 0, 6, 1, 4, 2])  # row i's cache in slot perm[i] (slot 5 holds no row)
    for moved, c in zip(k_moved + v_moved, k_cache + v_cache):
        moved[perm] = c[1:]
    ids = torch.randint(1, llama.config.vocab_size, (p, 5), generator=g)
    lengths, start = torch.tensor([5, 3, 1, 4, 5, 2]), torch.tensor([20, 7, 30, 12, 3, 25])
    with torch.inference_mode():
        direct = decoder.extend(ids, lengths, start, torch.arange(1, p + 1), k_cache, v_cache)
        moved = decoder.extend(ids, lengths, start, perm, k_moved, v_moved)
        # and a plain reference: each row alone, in a cache of one slot
        alone = [decoder.extend(ids[i:i + 1], lengths[i:i + 1], start[i:i + 1], torch.zeros(1, dtype=torch.long),
                                [c[i + 1:i + 2].clone() for c in k_cache], [c[i + 1:i + 2].clone() for c in v_cache])
                 for i in range(p)]
    assert torch.equal(direct, moved)
    assert all(torch.equal(m[perm], c[1:]) for m, c in zip(k_moved + v_moved, k_cache + v_cache))
    torch.testing.assert_close(torch.cat(alone), direct, rtol=1e-4, atol=1e-4)
