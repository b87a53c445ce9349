"""Tests for rlcore.engine.sequence and rlcore.rollout.hf on the one-layer tiny model.

The key property: the log-probs the HF engine returns while sampling equal a full training
forward over the finished sequences, which is what lets PPO skip recomputing them.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from rlcore.engine.model import load_causal_lm
from rlcore.engine.sequence import PADDED, local_model, position_ids, trim_left_padding
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.hf import HFRolloutEngine
from rlcore.rollout.sampling import filter_logits, sample_from

PAD = 0
NO_EOS = -1  # an id no model can emit: nothing stops early
MAX_NEW = 8


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_causal_lm(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def peaky(model):
    """The same model with logits scaled up, so samples repeat tokens and EOS-like stops happen."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)
    return m.eval()


@pytest.fixture(scope="module")
def prompts(model):
    """Four prompts of lengths 3, 7, 5, 1, left-padded: (rows, ids, mask)."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows = [torch.randint(7, vocab, (n,), generator=g).tolist() for n in (3, 7, 5, 1)]
    ids, mask = left_pad(rows)
    return rows, ids, mask


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def wider(ids: torch.Tensor, mask: torch.Tensor, extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rows behind ``extra`` more columns of left padding."""
    return (torch.cat([torch.full((len(ids), extra), PAD, dtype=ids.dtype), ids], 1),
            torch.cat([torch.zeros((len(mask), extra), dtype=mask.dtype), mask], 1))


@torch.no_grad()
def plain_response_log_probs(model, prompt: list[int], response: list[int], temperature: float = 1.0):
    """One unpadded sequence, default positions, no mask: log p(response_t | prefix)."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].float() / temperature
    logp = F.log_softmax(logits, dim=-1)
    p = len(prompt)
    return torch.stack([logp[p - 1 + t, tok] for t, tok in enumerate(response)])


@torch.no_grad()
def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n argmax tokens, each from a full forward over the unpadded sequence so far (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def engine(model, eos: int) -> HFRolloutEngine:
    return HFRolloutEngine(model, eos_token_id=eos, pad_token_id=PAD)


def sample(model, prompts, *, eos: int, seed: int, **params):
    _, ids, mask = prompts
    g = torch.Generator().manual_seed(seed)
    return engine(model, eos).generate(ids, mask, SamplingParams(max_new_tokens=MAX_NEW, **params), generator=g)


# ------------------------------------------------------------------ sequence.py
def test_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 1, 1, 1]]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_response_log_probs_equal_a_plain_forward(model, temperature):
    prompt, response = [10, 20, 30, 40], [50, 60, 70]
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        lp, ent = local_model(model).response_log_probs(ids, torch.ones_like(ids), torch.tensor([response]),
                                     temperature=temperature, with_entropy=True)
    expected = plain_response_log_probs(model, prompt, response, temperature)
    torch.testing.assert_close(lp[0], expected, atol=1e-5, rtol=0)
    assert ent.shape == (1, 3) and bool((ent > 0).all()) and bool((ent <= math.log(model.config.vocab_size)).all())


def test_log_probs_do_not_depend_on_left_padding(model, prompts):
    rows, ids, pmask = prompts
    g = torch.Generator().manual_seed(1)
    responses = torch.randint(7, model.config.vocab_size, (len(rows), 5), generator=g)
    lengths = [5, 2, 4, 1]  # right padding too: row i's response has lengths[i] real tokens
    rmask = torch.zeros_like(responses)
    for i, n in enumerate(lengths):
        rmask[i, :n] = 1
        responses[i, n:] = PAD
    with torch.no_grad():
        lp, _ = local_model(model).response_log_probs(torch.cat([ids, responses], 1), torch.cat([pmask, rmask], 1), responses)
    for i, n in enumerate(lengths):
        expected = plain_response_log_probs(model, rows[i], responses[i, :n].tolist())
        torch.testing.assert_close(lp[i, :n], expected, atol=1e-5, rtol=0)


def test_response_logits_equal_the_full_logits_slice_and_only_those_are_projected(model, prompts):
    _, ids, pmask = prompts
    seq, mask = torch.cat([ids, ids[:, :4]], 1), torch.cat([pmask, torch.ones_like(pmask[:, :4])], 1)
    projected = []
    hook = model.lm_head.register_forward_hook(lambda _, args, out: projected.append(out.shape[1]))
    try:
        with torch.no_grad():
            got = PADDED.response_logits(model, seq, mask, 4)
            full = model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask)).logits
    finally:
        hook.remove()
    assert projected == [5, seq.shape[1]]  # response_len + 1 positions, then the full forward's all
    torch.testing.assert_close(got, full[:, -5:-1], atol=1e-6, rtol=0)


def test_trim_left_padding_drops_only_leading_columns_that_no_row_uses():
    mask = torch.tensor([[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 0, 0]])
    ids = torch.arange(12).reshape(2, 6)
    got_ids, got_mask = trim_left_padding(ids, mask)
    assert got_mask.tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]]  # the trailing all-padding column stays
    assert torch.equal(got_ids, ids[:, 2:])
    empty = torch.zeros_like(mask)
    assert torch.equal(trim_left_padding(ids, empty)[1], empty)


def test_log_probs_over_trimmed_columns_equal_the_untrimmed_forward(model, prompts):
    _, ids, pmask = prompts
    responses = torch.randint(7, model.config.vocab_size, (len(ids), 5), generator=torch.Generator().manual_seed(2))
    wide_ids, wide_mask = wider(torch.cat([ids, responses], 1), torch.cat([pmask, torch.ones_like(responses)], 1), 6)
    trimmed_ids, trimmed_mask = trim_left_padding(wide_ids, wide_mask)
    assert trimmed_ids.shape[1] == ids.shape[1] + 5
    with torch.no_grad():
        lp, ent = local_model(model).response_log_probs(trimmed_ids, trimmed_mask, responses, with_entropy=True)
        wide_lp, wide_ent = local_model(model).response_log_probs(wide_ids, wide_mask, responses, with_entropy=True)
    torch.testing.assert_close(lp, wide_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, wide_ent, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ rollout/hf.py
def test_generation_runs_on_trimmed_prompts_and_extra_left_padding_changes_nothing(peaky, prompts):
    rows, ids, mask = prompts
    widths = []
    hook = peaky.register_forward_pre_hook(lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        out = sample(peaky, prompts, eos=NO_EOS, seed=4, temperature=1.5)
        prefills = len(widths)
        wide = sample(peaky, (rows, *wider(ids, mask, 7)), eos=NO_EOS, seed=4, temperature=1.5)
    finally:
        hook.remove()
    assert widths[0] == widths[prefills] == ids.shape[1]  # both prefills see the longest prompt's width
    assert torch.equal(wide["responses"], out["responses"])
    assert torch.equal(wide["response_mask"], out["response_mask"])
    torch.testing.assert_close(wide["log_probs"], out["log_probs"], atol=1e-5, rtol=0)


def test_greedy_equals_argmax_of_full_forwards(peaky, prompts):
    rows = prompts[0]
    out = sample(peaky, prompts, eos=NO_EOS, seed=0, greedy=True)
    expected = [reference_greedy(peaky, r, MAX_NEW) for r in rows]
    assert out["responses"].tolist() == expected
    assert out["response_mask"].tolist() == [[1] * MAX_NEW] * len(rows)


def test_generation_stops_at_eos_and_pads_after_it(peaky, prompts):
    rows = prompts[0]
    full = [reference_greedy(peaky, r, MAX_NEW) for r in rows]
    # An "EOS" that row 0 produces at some step t >= 1 (and not before).
    t = next(i for i in range(1, MAX_NEW) if full[0][i] not in full[0][:i])
    eos = full[0][t]
    out = sample(peaky, prompts, eos=eos, seed=0, greedy=True)
    for i, seq in enumerate(full):
        stop = seq.index(eos) if eos in seq else MAX_NEW - 1
        assert out["response_mask"][i].tolist() == [1] * (stop + 1) + [0] * (MAX_NEW - stop - 1), i
        assert out["responses"][i].tolist() == seq[: stop + 1] + [PAD] * (MAX_NEW - stop - 1), i
        assert out["log_probs"][i, stop + 1:].abs().sum() == 0
    assert int(out["response_mask"][0].sum()) == t + 1


def test_sampled_log_probs_equal_a_training_forward(peaky, prompts):
    _, ids, pmask = prompts
    first = sample(peaky, prompts, eos=NO_EOS, seed=3, temperature=0.7)
    eos = int(first["responses"][0, 2])  # so some rows end early: both masks are exercised
    out = sample(peaky, prompts, eos=eos, seed=3, temperature=0.7)
    rmask = out["response_mask"]
    assert 0 < rmask.sum() < rmask.numel()
    with torch.no_grad():
        lp, _ = local_model(peaky).response_log_probs(torch.cat([ids, out["responses"]], 1), torch.cat([pmask, rmask], 1),
                                   out["responses"], temperature=0.7)
    torch.testing.assert_close(out["log_probs"], lp * rmask, atol=1e-4, rtol=0)
    # Same seed, same draws: the EOS run is the first run cut at each row's first EOS.
    for i in range(len(ids)):
        seq = first["responses"][i].tolist()
        n = seq.index(eos) + 1 if eos in seq else MAX_NEW
        assert rmask[i].tolist() == [1] * n + [0] * (MAX_NEW - n), i
        assert out["responses"][i].tolist() == seq[:n] + [PAD] * (MAX_NEW - n), i


def test_same_generator_seed_gives_the_same_samples(peaky, prompts):
    torch.manual_seed(1)  # the global RNG differs between the runs; only the generator may matter
    a = sample(peaky, prompts, eos=NO_EOS, seed=11, temperature=1.5)
    torch.manual_seed(2)
    b = sample(peaky, prompts, eos=NO_EOS, seed=11, temperature=1.5)
    c = sample(peaky, prompts, eos=NO_EOS, seed=12, temperature=1.5)
    assert torch.equal(a["responses"], b["responses"]) and torch.equal(a["log_probs"], b["log_probs"])
    assert not torch.equal(a["responses"], c["responses"])


def test_top_k_1_sampling_equals_greedy(peaky, prompts):
    greedy = sample(peaky, prompts, eos=NO_EOS, seed=0, greedy=True)
    top1 = sample(peaky, prompts, eos=NO_EOS, seed=5, top_k=1)
    assert torch.equal(top1["responses"], greedy["responses"])
    torch.testing.assert_close(top1["log_probs"], greedy["log_probs"], atol=1e-6, rtol=0)


def test_inverse_cdf_sampling_draws_each_token_with_its_probability():
    expected = torch.tensor([[0.0, 0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.1, 0.9, 0.0]])  # zeros at both ends
    probs = expected.repeat(20_000, 1)  # [40000, 5], the two rows alternating
    draws = sample_from(probs, torch.Generator().manual_seed(0))
    for row in range(2):
        share = torch.bincount(draws[row::2], minlength=5).double() / 20_000
        sigma = (expected[row] * (1 - expected[row]) / 20_000).sqrt().double()
        assert ((share - expected[row]).abs() <= 5 * sigma).all(), (row, share)  # zero-probability: exactly 0
    assert torch.equal(sample_from(probs, torch.Generator().manual_seed(3)),
                       sample_from(probs, torch.Generator().manual_seed(3)))


def test_inverse_cdf_sampling_accepts_unnormalised_rows():
    draws = sample_from(torch.tensor([[0.0, 2.0, 6.0]]).repeat(8000, 1), torch.Generator().manual_seed(1))
    assert 0.72 < float((draws == 2).double().mean()) < 0.78 and not (draws == 0).any()


# ------------------------------------------------------------------ filter_logits
def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in logits]


def test_top_p_keeps_the_minimal_nucleus():
    # Row 0 probabilities 0.15, 0.5, 0.05, 0.3; row 1 the same values in another order.
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3], [0.3, 0.05, 0.5, 0.15]])
    logits = probs.log()
    # 0.75: 0.5 alone is short, 0.5 + 0.3 reaches it -> the two largest.
    assert kept(filter_logits(logits, 0, 0.75)) == [[1, 3], [0, 2]]
    # 0.85: needs 0.5 + 0.3 + 0.15.
    assert kept(filter_logits(logits, 0, 0.85)) == [[0, 1, 3], [0, 2, 3]]
    # 0.4: the top token alone already covers it.
    assert kept(filter_logits(logits, 0, 0.4)) == [[1], [2]]
    # Kept logits are unchanged.
    out = filter_logits(logits, 0, 0.75)
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])


def test_top_k_and_top_p_together():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    assert kept(filter_logits(logits, 3, 1.0)) == [[0, 1, 3]]
    # top-k 3 first renormalises to 0.158, 0.526, 0.316: 0.526 + 0.316 >= 0.8.
    assert kept(filter_logits(logits, 3, 0.8)) == [[1, 3]]
    assert kept(filter_logits(logits, 0, 1.0)) == [[0, 1, 2, 3]]
