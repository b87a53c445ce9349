"""The vLLM engine (rlcore.rollout.vllm_engine) on vLLM's CPU build, against the HF token loop and a trainer forward.

One engine for the module (vLLM's import and start-up take tens of seconds): greedy tokens equal the ``hf`` engine's
on left-padded prompts of different lengths with EOS stops; its log-probs of given responses equal a plain forward's
to float tolerance, and so do the log-probs it returns for its sampled tokens (temperature applied); sampling is
reproducible by the call's generator; new weights (a whole model, then LoRA adapters merged) show in the next
generation; starting an engine leaves the process's global random stream as it was. Runs where vLLM is installed (`make test-vllm`, CI); skipped elsewhere.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from rlcore.engine import lora
from rlcore.engine.tiny_model import build_char_tokenizer, build_tiny_model
from rlcore.rollout import EngineSpec, make_engine
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.hf import HFRolloutEngine
from tests.engine.test_static_engine import left_padded

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test-vllm)")]

PAD = 0
MAX_NEW = 12


def tiny(seed: int) -> torch.nn.Module:
    """The built-in Llama at head_dim 64 (what vLLM's CPU attention runs), logits scaled up so that greedy
    continuations differ between prompts and a common token can serve as EOS."""
    m = build_tiny_model(build_char_tokenizer(), arch="llama", hidden_size=128, num_layers=2, num_heads=2,
                         intermediate_size=256, max_position_embeddings=128, seed=seed).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    return m


@pytest.fixture(scope="module")
def model():
    return tiny(0)


@pytest.fixture(scope="module")
def engine(model):
    return make_engine(copy.deepcopy(model), EngineSpec("vllm", kv_cache_gib=0.25, max_batch=64), eos_token_id=-1,
                       pad_token_id=PAD)


def prompts(lengths: list[int], repeat: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded(100, lengths, repeat, seed)


def forward_log_probs(model, ids, mask, responses, temperature: float = 1.0) -> torch.Tensor:
    return HFRolloutEngine(model, eos_token_id=-1, pad_token_id=PAD).log_probs(ids, mask, responses) \
        if temperature == 1.0 else _scaled(model, ids, mask, responses, temperature)


def _scaled(model, ids, mask, responses, temperature):
    from rlcore.engine.sequence import position_ids

    full = torch.cat([ids, responses], 1)
    m = torch.cat([mask, torch.ones_like(responses)], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=m, position_ids=position_ids(m)).logits
    logits = logits[:, ids.shape[1] - 1:-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, responses[..., None]).squeeze(-1)


def greedy(engine, ids, mask, eos: int = -1):
    engine.eos_token_id = eos
    return engine.generate(ids, mask, SamplingParams(max_new_tokens=MAX_NEW, greedy=True))


def test_greedy_tokens_equal_the_hf_engines_with_eos_stops(model, engine):
    ids, mask = prompts([3, 9, 5, 14, 1, 7])
    free = HFRolloutEngine(model, eos_token_id=-1, pad_token_id=PAD).generate(
        ids, mask, SamplingParams(max_new_tokens=MAX_NEW, greedy=True))["responses"]
    # an EOS that some rows emit and others do not: rows stop at different steps
    counts = torch.stack([(free == t).any(1) for t in range(103)]).sum(1)
    counts[(counts == len(free)) | (torch.arange(103) == PAD)] = 0
    eos = int(counts.argmax())
    assert 0 < int(counts[eos]) < len(free)
    want = HFRolloutEngine(model, eos_token_id=eos, pad_token_id=PAD).generate(
        ids, mask, SamplingParams(max_new_tokens=MAX_NEW, greedy=True))
    got = greedy(engine, ids, mask, eos)
    assert torch.equal(got["responses"], want["responses"])
    assert torch.equal(got["response_mask"], want["response_mask"])
    stopped = got["response_mask"].sum(1) < MAX_NEW
    assert stopped.any() and not stopped.all()
    # the EOS is kept, as the other engines keep it: the last masked token of a stopped row
    last = got["response_mask"].sum(1) - 1
    assert (got["responses"][stopped, last[stopped]] == eos).all()


def test_log_probs_of_given_responses_equal_a_forward(model, engine):
    ids, mask = prompts([4, 11, 6], seed=1)
    responses = torch.randint(7, 100, (3, 9), generator=torch.Generator().manual_seed(2))
    want = forward_log_probs(model, ids, mask, responses)
    got = engine.log_probs(ids, mask, responses)
    assert got.shape == responses.shape
    assert float((got - want).abs().max()) < 1e-4  # float32: the same numbers computed by other kernels


def test_sampled_log_probs_are_the_tempered_distributions_and_a_generator_repeats_a_call(model, engine):
    ids, mask = prompts([5, 8], repeat=8, seed=3)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7)
    engine.eos_token_id = -1
    a = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(11))
    b = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(11))
    c = engine.generate(ids, mask, params, generator=torch.Generator().manual_seed(12))
    assert torch.equal(a["responses"], b["responses"])
    assert not torch.equal(a["responses"], c["responses"])
    assert len({tuple(r) for r in a["responses"][:8].tolist()}) > 1  # a group's rows differ
    want = forward_log_probs(model, ids, mask, a["responses"], temperature=0.7)
    assert float((a["log_probs"] - want).abs().max()) < 1e-4


def test_new_weights_show_in_the_next_generation(model, engine):
    ids, mask = prompts([6, 10, 3], seed=4)
    other = tiny(1)
    before = greedy(engine, ids, mask)["responses"]
    engine.load_weights(other.state_dict())
    try:
        after = greedy(engine, ids, mask)["responses"]
        want = HFRolloutEngine(other, eos_token_id=-1, pad_token_id=PAD).generate(
            ids, mask, SamplingParams(max_new_tokens=MAX_NEW, greedy=True))["responses"]
        assert torch.equal(after, want) and not torch.equal(after, before)
    finally:
        engine.load_weights(model.state_dict())
    assert torch.equal(greedy(engine, ids, mask)["responses"], before)


def test_lora_adapters_reach_vllm_merged(model):
    spec = lora.LoraSpec(rank=4, alpha=8.0)
    policy = lora.add_adapter(copy.deepcopy(model), spec, seed=0)
    with torch.no_grad():  # B starts at zero (the adapter a no-op): give it weights that change the output
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    adapters = {k: v for k, v in policy.state_dict().items() if lora.is_adapter_key(k)}
    host = lora.add_adapter(copy.deepcopy(model), spec, seed=0)
    rng = torch.get_rng_state()
    eng = make_engine(host, EngineSpec("vllm", kv_cache_gib=0.25, max_batch=64), eos_token_id=-1, pad_token_id=PAD)
    assert torch.equal(torch.get_rng_state(), rng)  # vLLM seeds the global generators at start: put back
    ids, mask = prompts([5, 9], seed=5)
    before = greedy(eng, ids, mask)["responses"]
    eng.load_weights(adapters)
    want = HFRolloutEngine(policy.eval(), eos_token_id=-1, pad_token_id=PAD).generate(
        ids, mask, SamplingParams(max_new_tokens=MAX_NEW, greedy=True))["responses"]
    got = greedy(eng, ids, mask)["responses"]
    assert torch.equal(got, want) and not torch.equal(got, before)
