"""The static-cache engine (rlcore.rollout.static) against the HF token loop and against the model itself.

Greedy: the same tokens as the HF engine, and as argmax over full uncached forwards, on the built-in
tiny Llama and on a Qwen2-shaped model (grouped-query attention, q/k/v biases), with EOS stops that
finish rows at different steps (so the batch is compacted mid-call). Sampling: with the same generator
the same tokens as the HF engine (both draw one uniform per original row per step); the empirical
distribution of each position's token matches the model's probabilities within a stated tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from rlcore.engine.model import load_causal_lm
from rlcore.rollout import EngineSpec, make_engine
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.hf import HFRolloutEngine
from rlcore.rollout.static import StaticRolloutEngine, buckets_for, unsupported_reason
from rlcore.serve.batcher import left_pad

PAD = 0
MAX_NEW = 10


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    """The tiny Llama with logits scaled up: peaky distributions, so a common token can serve as EOS."""
    m = copy.deepcopy(load_causal_lm(tiny_model_dir).eval())
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)
    return m


@pytest.fixture(scope="module")
def qwen2():
    """A random Qwen2-shaped decoder: 4 query / 2 key-value heads, q/k/v biases, rope theta 1e6."""
    config = AutoConfig.for_model("qwen2", vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                                  rope_theta=1e6, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(3)
    m = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in m.model.layers:  # biases are zero-initialised: make them count
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
        m.lm_head.weight.mul_(8.0)
    return m


def left_padded(vocab: int, lengths: list[int], repeat: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of ``lengths`` (each repeated ``repeat`` times, as a GRPO group), left-padded."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    rows = []
    for n in lengths:
        rows += [torch.randint(7, vocab, (n,), generator=g).tolist()] * repeat
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def common_token(model, ids, mask) -> int:
    """A token the greedy continuation emits in some rows but not all: as EOS it stops rows at different steps."""
    out = HFRolloutEngine(model, eos_token_id=-1, pad_token_id=PAD).generate(
        ids, mask, SamplingParams(max_new_tokens=MAX_NEW, greedy=True))
    tokens = out["responses"]
    rows_with = torch.stack([(tokens == tok).any(1) for tok in range(model.config.vocab_size)]).sum(1)
    rows_with[PAD] = 0
    rows_with[rows_with == len(tokens)] = 0  # a token in every row would stop them all
    assert int(rows_with.max()) > 0, "no token separates the rows"
    return int(rows_with.argmax())  # the token in the most rows: most rows stop early


@torch.no_grad()
def uncached_greedy(model, prompt: list[int], n: int, eos: int) -> list[int]:
    """Argmax tokens, each from a full forward over the unpadded sequence so far, stopping after EOS."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        if seq[-1] == eos:
            break
    return seq[len(prompt):]


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_greedy_tokens_equal_the_hf_engine_and_uncached_argmax(which, request):
    model = request.getfixturevalue(which)
    ids, mask = left_padded(model.config.vocab_size, [3, 7, 5, 1, 6], repeat=3)
    eos = common_token(model, ids, mask)
    params = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    static = StaticRolloutEngine(model, eos_token_id=eos, pad_token_id=PAD)
    got = static.generate(ids, mask, params)
    want = HFRolloutEngine(model, eos_token_id=eos, pad_token_id=PAD).generate(ids, mask, params)
    assert torch.equal(got["responses"], want["responses"])
    assert torch.equal(got["response_mask"], want["response_mask"])
    torch.testing.assert_close(got["log_probs"], want["log_probs"], atol=1e-5, rtol=0)
    lengths = got["response_mask"].sum(1)
    assert 1 <= int(lengths.min()) < int(lengths.max()) == MAX_NEW  # rows stopped at different steps
    if which == "llama":  # a quarter of the rows finish early here: they left the batch mid-call
        assert static.stats["compactions"] >= 1 and static.stats["decode_rows"] < len(ids) * (MAX_NEW - 1)
    for i in range(len(ids)):
        prompt = ids[i][mask[i].bool()].tolist()
        n = int(lengths[i])
        assert got["responses"][i, :n].tolist() == uncached_greedy(model, prompt, MAX_NEW, eos)
        assert got["responses"][i, n:].eq(PAD).all()


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_seeded_sampling_draws_the_same_tokens_as_the_hf_engine(which, request):
    model = request.getfixturevalue(which)
    ids, mask = left_padded(model.config.vocab_size, [4, 2, 6, 5], repeat=4, seed=1)
    eos = common_token(model, ids, mask)
    for params in (SamplingParams(max_new_tokens=MAX_NEW, temperature=1.5),
                   SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_k=5, top_p=0.9)):
        got = StaticRolloutEngine(model, eos_token_id=eos, pad_token_id=PAD).generate(
            ids, mask, params, torch.Generator().manual_seed(7))
        want = HFRolloutEngine(model, eos_token_id=eos, pad_token_id=PAD).generate(
            ids, mask, params, torch.Generator().manual_seed(7))
        assert torch.equal(got["responses"], want["responses"])
        torch.testing.assert_close(got["log_probs"], want["log_probs"], atol=1e-5, rtol=0)


def chi2_threshold(dof: int) -> float:
    """Mean plus 6 standard deviations of a chi-square with ``dof`` degrees of freedom (a false alarm
    well under one in a million runs; a wrong distribution lands far above)."""
    return dof + 6 * (2 * dof) ** 0.5


def chi2_against(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``probs``; bins expecting under 5 draws are pooled."""
    n = counts.sum().item()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    return float(((obs - exp) ** 2 / exp)[keep].sum()), int(keep.sum()) - 1


def chi2_two_samples(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Two equal-size samples' counts from one distribution: sum (a - b)^2 / (a + b) over bins with at
    least 10 draws in all (the rest pooled) is chi-square with bins - 1 degrees of freedom."""
    a, b = a.double(), b.double()
    big = (a + b) >= 10
    a = torch.cat([a[big], a[~big].sum()[None]])
    b = torch.cat([b[big], b[~big].sum()[None]])
    keep = (a + b) > 0
    return float(((a - b) ** 2 / (a + b))[keep].sum()), int(keep.sum()) - 1


def test_sampled_tokens_follow_the_model_distribution_at_each_position(llama):
    """Many rows of one prompt, three new tokens, temperature 1.5. Position 0: the counts against
    softmax(logits / T) of a plain forward (Pearson chi-square). Positions 1 and 2 (marginals over the
    earlier tokens): the counts against the HF engine's, drawn with another seed (two-sample chi-square).
    Tolerance: the statistic under its mean + 6 standard deviations."""
    n, temperature = 4000, 1.5
    ids, mask = left_padded(llama.config.vocab_size, [5], repeat=n, seed=4)
    params = SamplingParams(max_new_tokens=3, temperature=temperature)
    got = StaticRolloutEngine(llama, eos_token_id=-1, pad_token_id=PAD).generate(
        ids, mask, params, torch.Generator().manual_seed(11))
    vocab = llama.config.vocab_size
    with torch.no_grad():
        logits = llama(input_ids=ids[:1]).logits[0, -1].float()
    counts0 = torch.bincount(got["responses"][:, 0], minlength=vocab)
    stat, dof = chi2_against(counts0, F.softmax(logits / temperature, -1))
    assert dof >= 5 and stat < chi2_threshold(dof)
    # the same check rejects the distribution at temperature 1: the test has teeth
    stat, dof = chi2_against(counts0, F.softmax(logits, -1))
    assert stat > 3 * chi2_threshold(dof)
    other = HFRolloutEngine(llama, eos_token_id=-1, pad_token_id=PAD).generate(
        ids, mask, params, torch.Generator().manual_seed(12))
    for t in (1, 2):
        stat, dof = chi2_two_samples(torch.bincount(got["responses"][:, t], minlength=vocab),
                                     torch.bincount(other["responses"][:, t], minlength=vocab))
        assert dof >= 5 and stat < chi2_threshold(dof)


def test_new_weights_take_effect_without_rebuilding_the_cache(llama):
    ids, mask = left_padded(llama.config.vocab_size, [4, 6], repeat=2, seed=5)
    params = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    engine = StaticRolloutEngine(copy.deepcopy(llama), eos_token_id=-1, pad_token_id=PAD)
    before = engine.generate(ids, mask, params)["responses"]
    cache = engine.cache[0][0]
    changed = copy.deepcopy(llama)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.load_weights(changed.state_dict())
    after = engine.generate(ids, mask, params)["responses"]
    want = HFRolloutEngine(changed, eos_token_id=-1, pad_token_id=PAD).generate(ids, mask, params)["responses"]
    assert torch.equal(after, want) and not torch.equal(after, before)
    assert engine.cache[0][0] is cache  # the same preallocated cache served both calls


def test_a_larger_batch_grows_the_cache_and_shorter_prompts_reuse_it(llama):
    engine = StaticRolloutEngine(llama, eos_token_id=-1, pad_token_id=PAD)
    params = SamplingParams(max_new_tokens=4, greedy=True)
    for lengths, repeat in (([6, 3], 2), ([2], 3), ([7, 7, 1], 4)):
        ids, mask = left_padded(llama.config.vocab_size, lengths, repeat=repeat, seed=len(lengths))
        got = engine.generate(ids, mask, params)
        want = HFRolloutEngine(llama, eos_token_id=-1, pad_token_id=PAD).generate(ids, mask, params)
        assert torch.equal(got["responses"], want["responses"])
    assert engine.cache[0][0].shape[0] == 12  # grown to the largest batch


def test_buckets_cover_every_batch_size():
    assert buckets_for(12) == [1, 2, 4, 8, 12]
    assert buckets_for(16) == [1, 2, 4, 8, 16]
    assert buckets_for(1) == [1]


def test_an_unsupported_architecture_falls_back_to_the_hf_engine(capsys):
    config = AutoConfig.for_model("gpt2", vocab_size=40, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    model = AutoModelForCausalLM.from_config(config)
    assert "gpt2" in unsupported_reason(config)
    engine = make_engine(model, EngineSpec("static"), eos_token_id=3, pad_token_id=0)
    assert isinstance(engine, HFRolloutEngine)
    assert "generating with hf" in capsys.readouterr().err


def test_a_prompt_past_the_model_positions_is_refused(qwen2):
    ids, mask = left_padded(qwen2.config.vocab_size, [60], repeat=1)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        StaticRolloutEngine(qwen2, eos_token_id=-1, pad_token_id=PAD).generate(
            ids, mask, SamplingParams(max_new_tokens=8))


class SwitchAt:
    """A weight refresh that loads ``state`` into ``engine`` at its ``at``-th poll (one poll per decode step)."""

    def __init__(self, engine, state: dict, at: int):
        self.engine, self.state, self.at, self.polls, self.version = engine, state, at, 0, 0

    def poll(self) -> bool:
        self.polls += 1
        if self.polls != self.at:
            return False
        self.engine.load_weights(self.state)
        self.version = 1
        return True


@torch.no_grad()
def token_log_probs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """Each response token's log-prob under ``model``, from one full forward over the unpadded sequence."""
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float() / temperature
    picked = F.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(response)], -1)
    return picked[torch.arange(len(response)), torch.tensor(response)].tolist()


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_weights_taken_mid_generation_score_each_token_with_the_version_that_sampled_it(which, request):
    """Partial rollouts: new weights loaded between decode steps 3 and 4. The tokens before are those of a run with
    the old weights alone (the same generator); every token's log-prob is that of the version that sampled it, given
    everything before it, worked out with a plain forward of that version over the whole sequence (so the rows' KV
    cache was computed again with the new weights, not kept from the old); token_versions says which."""
    model = request.getfixturevalue(which)
    ids, mask = left_padded(model.config.vocab_size, [3, 7, 5], repeat=3, seed=2)
    eos = common_token(model, ids, mask)
    params, switch = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.3), 4
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    old_only = StaticRolloutEngine(copy.deepcopy(model), eos_token_id=eos, pad_token_id=PAD).generate(
        ids, mask, params, torch.Generator().manual_seed(3))
    engine = StaticRolloutEngine(copy.deepcopy(model), eos_token_id=eos, pad_token_id=PAD)
    refresh = SwitchAt(engine, changed.state_dict(), at=switch)
    got = engine.generate(ids, mask, params, torch.Generator().manual_seed(3), refresh=refresh)
    assert engine.stats["refills"] == 1
    lengths = got["response_mask"].sum(1)
    assert int(lengths.max()) > switch  # some rows ran past the switch
    assert torch.equal(got["responses"][:, :switch], old_only["responses"][:, :switch])
    for i in range(len(ids)):
        prompt, n = ids[i][mask[i].bool()].tolist(), int(lengths[i])
        response = got["responses"][i, :n].tolist()
        assert got["token_versions"][i, :n].tolist() == [0 if t < switch else 1 for t in range(n)]
        want = [old if t < switch else new for t, (old, new) in enumerate(zip(
            token_log_probs(model, prompt, response, params.temperature),
            token_log_probs(changed, prompt, response, params.temperature)))]
        torch.testing.assert_close(got["log_probs"][i, :n], torch.tensor(want), atol=1e-4, rtol=0)


@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_a_kept_prefix_continues_a_longer_prompt_as_a_whole_prefill_would(which, request):
    """keep_prefixes: each row's keys and values at its end are those of a plain forward over its prompt and tokens
    but the last (the row's own slot copied out before the batch was compacted). A second call whose prompts extend
    the first's rows (prompt, response, new tokens: the openai loop's next request) computes only the new tokens
    from them and samples what a call without them samples: the same greedy tokens, log-probs within float
    rounding. A prefix of other weights (after load_weights), or of other tokens, is not used."""
    model = request.getfixturevalue(which)
    vocab = model.config.vocab_size
    ids, mask = left_padded(vocab, [3, 7, 5, 4], repeat=2, seed=5)
    eos = common_token(model, ids, mask)
    params = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    engine = StaticRolloutEngine(copy.deepcopy(model), eos_token_id=eos, pad_token_id=PAD)
    first = engine.generate(ids, mask, params, keep_prefixes=True)
    lengths = first["response_mask"].sum(1)
    assert 1 <= int(lengths.min()) < int(lengths.max())  # rows ended at different steps (and were compacted)
    longer, kept = [], first["prefixes"]
    for i, prefix in enumerate(kept):
        prompt, response = ids[i][mask[i].bool()].tolist(), first["responses"][i, :int(lengths[i])].tolist()
        assert prefix.ids == tuple(prompt + response[:-1])
        with torch.no_grad():
            cache = model(input_ids=torch.tensor([list(prefix.ids)])).cache  # HF's own forward's keys and values
        for layer, (k, v) in enumerate(zip(prefix.keys, prefix.values)):
            torch.testing.assert_close(k, cache.layers[layer].keys[0], atol=1e-4, rtol=0)
            torch.testing.assert_close(v, cache.layers[layer].values[0], atol=1e-4, rtol=0)
        longer.append(prompt + response + [7 + i, 9])  # the agent's next message
    ids2, mask2 = left_pad(longer, PAD)
    whole = StaticRolloutEngine(copy.deepcopy(model), eos_token_id=eos, pad_token_id=PAD).generate(
        ids2, mask2, params)
    got = engine.generate(ids2, mask2, params, prefixes=kept)
    assert engine.stats["prefix_tokens"] == sum(len(p.ids) for p in kept)
    assert torch.equal(got["responses"], whole["responses"])
    torch.testing.assert_close(got["log_probs"], whole["log_probs"], atol=1e-4, rtol=0)
    other = [[t + 1 if t + 1 < vocab else 7 for t in row[:2]] + row[2:] for row in longer]  # differs at token 0
    before = engine.stats["prefix_tokens"]
    engine.generate(*left_pad(other, PAD), params, prefixes=kept)
    assert engine.stats["prefix_tokens"] == before + sum(min(p.common_length(r), len(r) - 1)
                                                         for p, r in zip(kept, other))
    engine.load_weights(model.state_dict())
    engine.generate(ids2, mask2, params, prefixes=kept)
    assert engine.stats["prefix_tokens"] == before + sum(min(p.common_length(r), len(r) - 1)
                                                         for p, r in zip(kept, other))

