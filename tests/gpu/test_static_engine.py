"""The static rollout engine on one CUDA GPU (CUDA graphs, optionally compiled) against the HF engine.

Every test is skipped on a machine without CUDA. The reference is ``HFRolloutEngine`` (the transformers
forward with a ``DynamicCache``) over its own copy of the same weights; the static engine runs its own
functional decoder over a preallocated cache, with each decode bucket captured in a CUDA graph, so
agreement is between two independent computations. Models: a random Qwen2-shaped decoder with grouped-
query attention (4 query / 2 key-value heads) and non-zero q/k/v biases, and the built-in tiny Llama
(``tests/conftest.py``). Float32 matmuls run at "highest" precision (no TF32): greedy and seeded
sampled tokens must be equal. EOS is a token the HF engine emits in at least half of the rows (picked
from an EOS-free run), so rows finish at different steps and the batch is compacted into smaller,
separately captured buckets during the call.

Run on a GPU machine::

    python -m pytest tests/gpu -q
"""

from __future__ import annotations

import pytest
import torch

from rlcore.engine.model import load_causal_lm
from rlcore.rollout import EngineSpec, SamplingParams, make_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NEW = 24
ROWS = 16  # 8 distinct prompts x 2
QWEN_GQA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=False,
                initializer_range=0.2)  # wider than HF's 0.02: greedy responses that depend on the prompt
BF16_FIRST_TOKEN = 0.9  # bf16: share of rows whose first token (prefill) equals the HF engine's
BF16_ARGMAX = 0.9  # bf16: share of greedy tokens that are the argmax of a teacher-forced HF forward
BF16_NEAR = 0.98  # ... that are within BF16_MARGIN of its max logit
BF16_MARGIN = 2e-2


@pytest.fixture(scope="module")
def qwen_gqa_dir(tmp_path_factory):
    """A random Qwen2-shaped model (GQA, q/k/v biases made non-zero) with the char tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlcore.engine.tiny_model import build_char_tokenizer

    tok = build_char_tokenizer()
    config = AutoConfig.for_model("qwen2", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **QWEN_GQA)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)  # Qwen2 initialises them at 0: make them count
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    folder = tmp_path_factory.mktemp("qwen-gqa")
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(params=["qwen_gqa_dir", "tiny_model_dir"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def load(folder, dtype: str = "float32"):
    return load_causal_lm(folder, dtype=dtype).to("cuda").eval()


def prompts(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """8 distinct prompts of 3-12 ids (no special tokens), left-padded with 0, each twice."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 13, (ROWS // 2,), generator=g)
    lengths[0] = 12
    ids = torch.zeros((ROWS // 2, 12), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths.tolist()):
        ids[i, 12 - n:] = torch.randint(7, vocab, (n,), generator=g)
        mask[i, 12 - n:] = 1
    return ids.repeat_interleave(2, 0).cuda(), mask.repeat_interleave(2, 0).cuda()


def engines(folder, *, eos: int, dtype: str = "float32", compile: bool = False):
    """(static engine with CUDA graphs, HF engine), each over its own copy of the model."""
    static = make_engine(load(folder, dtype), EngineSpec("static", compile=compile, cuda_graphs=True),
                         eos_token_id=eos, pad_token_id=0)
    hf = make_engine(load(folder, dtype), EngineSpec("hf"), eos_token_id=eos, pad_token_id=0)
    assert type(static).__name__ == "StaticRolloutEngine" and static.use_graphs
    assert type(hf).__name__ == "HFRolloutEngine"
    return static, hf


def run(engine, ids, mask, params: SamplingParams, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return engine.generate(ids, mask, params, g)


def frequent_token(folder, ids, mask) -> int:
    """A token the HF engine's greedy responses (no EOS) hold in at least half of the rows but not all,
    the most frequent such: as EOS it ends rows at different steps."""
    hf = make_engine(load(folder), EngineSpec("hf"), eos_token_id=-1, pad_token_id=0)
    responses = run(hf, ids, mask, SamplingParams(max_new_tokens=NEW, greedy=True))["responses"].cpu()
    vocab = int(responses.max()) + 1
    rows_with = torch.zeros(vocab, dtype=torch.long)
    for row in responses:
        rows_with[row.unique()] += 1
    rows_with[rows_with >= len(responses)] = 0
    token = int(rows_with.argmax())
    assert rows_with[token] >= len(responses) // 2, f"no token in half of the rows: {responses}"
    return token


def assert_same(got: dict, expected: dict) -> None:
    assert torch.equal(got["response_mask"], expected["response_mask"])
    assert torch.equal(got["responses"], expected["responses"])
    real = expected["response_mask"].bool()
    torch.testing.assert_close(got["log_probs"][real], expected["log_probs"][real], atol=1e-4, rtol=1e-4)
    assert (got["log_probs"][~real] == 0).all()


def test_graphed_greedy_and_sampled_tokens_equal_the_hf_engine(model_dir):
    vocab = load(model_dir).config.vocab_size
    ids, mask = prompts(vocab)
    eos = frequent_token(model_dir, ids, mask)
    static, hf = engines(model_dir, eos=eos)
    greedy = SamplingParams(max_new_tokens=NEW, greedy=True)
    expected = run(hf, ids, mask, greedy)
    # the premise: rows end at different steps (some at once, some never)
    ends = expected["response_mask"].sum(-1)
    assert ends.min() < ends.max() and ends.max() == NEW, ends
    # the first call captures the buckets while it decodes (the full batch, then smaller ones)
    assert_same(run(static, ids, mask, greedy), expected)
    captures = static.stats["graph_captures"]
    assert captures >= 2 and static.stats["compactions"] >= 1, static.stats
    # a later call with the same rows replays the graphs captured by the first
    assert_same(run(static, ids, mask, greedy), expected)
    assert static.stats["graph_captures"] == captures
    sampling = SamplingParams(max_new_tokens=NEW, temperature=1.0)
    for seed in (1, 2):
        assert_same(run(static, ids, mask, sampling, seed), run(hf, ids, mask, sampling, seed))


def test_compiled_graphed_greedy_tokens_equal_the_hf_engine(qwen_gqa_dir):
    ids, mask = prompts(load(qwen_gqa_dir).config.vocab_size)
    static, hf = engines(qwen_gqa_dir, eos=-1, compile=True)
    greedy = SamplingParams(max_new_tokens=NEW, greedy=True)
    expected = run(hf, ids, mask, greedy)
    for _ in range(2):
        assert_same(run(static, ids, mask, greedy), expected)
    assert static.stats["graph_captures"] == 1  # no EOS: one bucket, the whole batch


def moved(state: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """New weights: every tensor plus noise of its own spread (at least 0.05)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for k, v in state.items():
        scale = max(float(v.float().std()) if v.numel() > 1 else 0.0, 0.05)
        out[k] = (v.float() + scale * torch.randn(v.shape, generator=g, device="cuda")).to(v.dtype)
    return out


def test_load_weights_reaches_the_graph_replays_without_a_recapture(model_dir):
    model = load(model_dir)
    ids, mask = prompts(model.config.vocab_size, seed=3)
    new_weights = moved(model.state_dict())
    static, hf = engines(model_dir, eos=-1)  # no EOS: the same single bucket before and after the update
    greedy = SamplingParams(max_new_tokens=NEW, greedy=True)
    old = run(static, ids, mask, greedy)
    assert_same(old, run(hf, ids, mask, greedy))
    captures = static.stats["graph_captures"]
    assert captures == 1
    static.load_weights(new_weights)
    hf.load_weights(new_weights)
    expected = run(hf, ids, mask, greedy)
    # the premise: the new weights change the responses
    assert not torch.equal(expected["responses"], old["responses"])
    assert_same(run(static, ids, mask, greedy), expected)
    sampling = SamplingParams(max_new_tokens=NEW, temperature=1.0)
    assert_same(run(static, ids, mask, sampling, 5), run(hf, ids, mask, sampling, 5))
    assert static.stats["graph_captures"] == captures


def test_a_larger_batch_after_a_small_one_recaptures_into_a_new_pool(qwen_gqa_dir):
    """A small batch, then one that outgrows the cache: the first graphs and their pool are dropped and the new
    graphs are captured into a fresh pool (capturing into the emptied one trips the allocator's assert)."""
    model = load(qwen_gqa_dir)
    ids, mask = prompts(model.config.vocab_size, seed=4)
    static, hf = engines(qwen_gqa_dir, eos=-1)
    greedy = SamplingParams(max_new_tokens=NEW, greedy=True)
    assert_same(run(static, ids[:2], mask[:2], SamplingParams(max_new_tokens=4, greedy=True)),
                run(hf, ids[:2], mask[:2], SamplingParams(max_new_tokens=4, greedy=True)))
    first_pool, captures = static.graph_pool, static.stats["graph_captures"]
    assert_same(run(static, ids, mask, greedy), run(hf, ids, mask, greedy))
    assert static.stats["graph_captures"] > captures
    assert static.graph_pool is not None and static.graph_pool != first_pool


def test_bfloat16_greedy_tokens_mostly_agree_with_the_hf_engine(qwen_gqa_dir):
    ids, mask = prompts(load(qwen_gqa_dir).config.vocab_size, seed=7)
    static, hf = engines(qwen_gqa_dir, eos=-1, dtype="bfloat16")
    assert static.cache is None or static.cache[0][0].dtype == torch.bfloat16
    greedy = SamplingParams(max_new_tokens=NEW, greedy=True)
    got = run(static, ids, mask, greedy)
    assert static.cache[0][0].dtype == torch.bfloat16 and static.stats["graph_captures"] == 1
    expected = run(hf, ids, mask, greedy)
    first = (got["responses"][:, 0] == expected["responses"][:, 0]).float().mean()
    assert first >= BF16_FIRST_TOKEN, (got["responses"], expected["responses"])
    # each greedy token against a teacher-forced forward of the HF model over the engine's own prefix
    model = hf.model
    full = torch.cat([ids, got["responses"]], 1)
    full_mask = torch.cat([mask, torch.ones_like(got["responses"])], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=full_mask,
                       position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    logits = logits[:, ids.shape[1] - 1 : -1]
    chosen = logits.gather(-1, got["responses"][..., None]).squeeze(-1)
    exact = (logits.argmax(-1) == got["responses"]).float().mean()
    near = (logits.max(-1).values - chosen <= BF16_MARGIN).float().mean()
    assert exact >= BF16_ARGMAX and near >= BF16_NEAR, (float(exact), float(near))
