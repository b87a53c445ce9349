"""Generation with per-row seeds (the engines' ``seeds``, what the openai loop's endpoint samples with): a row's tokens
and log-probs are those of its seed, whatever other rows share its engine call."""

from __future__ import annotations

import pytest
import torch

from rlcore.engine.tiny_model import build_char_tokenizer, build_tiny_model
from rlcore.rollout.hf import HFRolloutEngine
from rlcore.rollout.sampling import SamplingParams, row_uniforms
from rlcore.rollout.static import StaticRolloutEngine
from rlcore.serve.batcher import left_pad


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok, arch="llama", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                            max_position_embeddings=256, seed=11).eval()


def test_row_uniforms_depend_on_the_seed_alone():
    both = row_uniforms([3, 9], 5)
    assert torch.equal(both[1], row_uniforms([9], 5)[0]) and torch.equal(both[0], row_uniforms([3, 1, 2], 5)[0])
    assert not torch.equal(both[0], both[1]) and both.dtype == torch.float64


@pytest.mark.parametrize("engine_class", [StaticRolloutEngine, HFRolloutEngine])
def test_a_seeded_row_samples_the_same_tokens_and_log_probs_alone_or_in_company(tok, model, engine_class):
    """The row of seed 7 alone, then with three other prompts of other lengths (one longer, one shorter) around it,
    then with another call's generator: the same tokens and log-probs, bit for bit."""
    engine = engine_class(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    mine = tok("<s><|user|>what is 12*34?<|assistant|>", add_special_tokens=False)["input_ids"]
    others = [tok(t, add_special_tokens=False)["input_ids"] for t in
              ("<s><|user|>a much longer question than the other one<|assistant|>", "<s><|user|>hello!<|assistant|>")]
    params = SamplingParams(max_new_tokens=40, temperature=1.0)

    def row(prompts, seeds, generator_seed, at):
        ids, mask = left_pad(prompts, tok.pad_token_id)
        out = engine.generate(ids, mask, params, torch.Generator().manual_seed(generator_seed), seeds=seeds)
        n = int(out["response_mask"][at].sum())
        return out["responses"][at, :n], out["log_probs"][at, :n]

    alone = row([mine], [7], 0, 0)
    company = row([others[0], mine, others[1], others[0]], [1, 7, 2, 3], 5, 1)
    assert torch.equal(alone[0], company[0]) and torch.equal(alone[1], company[1])
    assert len(alone[0]) > 5
    other_seed = row([mine], [8], 0, 0)
    assert not torch.equal(alone[0][:len(other_seed[0])], other_seed[0][:len(alone[0])])
