"""Tests for rlcore.engine.packed: packed forwards equal padded ones, token for token.

The padded forward (``sdpa`` through transformers) is the reference: the packed one must give
the same log-probs, values and gradients at every real response token, for GRPO-style batches
(each prompt repeated), for every supported architecture, grouped-query attention included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from rlcore.engine import packed
from rlcore.engine.model import attention_for, load_causal_lm, load_value_model
from rlcore.engine.sequence import FORWARDS, forward_for, local_model
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.hf import HFRolloutEngine
from rlcore.rollout.sampling import distinct_rows

VOCAB = 50
PAD = 0


def save_model(folder, model_type: str, **extra):
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                  pad_token_id=PAD, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                                  **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


ARCHS = {
    "llama": dict(num_key_value_heads=4),
    "qwen2-gqa": dict(num_key_value_heads=2),  # two query heads per key/value head
    "qwen3": dict(num_key_value_heads=2, head_dim=8),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model_dir(request, tmp_path_factory):
    model_type = request.param.split("-")[0]
    return save_model(tmp_path_factory.mktemp(request.param), model_type, **ARCHS[request.param])


def grpo_batch(n_prompts=3, n=4, prompt_width=6, response_len=5, seed=0, pool=None):
    """Prompts of different lengths, each repeated ``n`` times, left-padded; responses of lengths 0..len,
    right-padded; with ``pool``, each row's response is one of ``pool`` responses drawn for its prompt (so
    rows repeat, as a confident policy's samples do). Returns (ids, mask, responses, response_mask)."""
    g = torch.Generator().manual_seed(seed)
    rows_ids, rows_mask, resp, rmask = [], [], [], []

    def draw() -> tuple[int, torch.Tensor]:
        k = int(torch.randint(0, response_len + 1, (), generator=g))
        r = torch.full((response_len,), PAD)
        r[:k] = torch.randint(3, VOCAB, (k,), generator=g)
        return k, r

    for p in range(n_prompts):
        length = 2 + p % (prompt_width - 1)
        prompt = torch.randint(3, VOCAB, (length,), generator=g)
        choices = [draw() for _ in range(pool)] if pool else None
        for _ in range(n):
            ids = torch.full((prompt_width,), PAD)
            ids[prompt_width - length:] = prompt
            m = (torch.arange(prompt_width) >= prompt_width - length).long()
            k, r = choices[int(torch.randint(0, pool, (), generator=g))] if pool else draw()
            rows_ids.append(ids)
            rows_mask.append(m)
            resp.append(r)
            rmask.append((torch.arange(response_len) < k).long())
    responses, response_mask = torch.stack(resp), torch.stack(rmask)
    ids = torch.cat([torch.stack(rows_ids), responses], 1)
    mask = torch.cat([torch.stack(rows_mask), response_mask], 1)
    return ids, mask, responses, response_mask


def test_the_layout_of_a_hand_built_batch():
    # rows 0 and 2 share prompt [5, 6]; row 1 has prompt [7, 8, 9]; responses of 2, 1 and 0 tokens
    ids = torch.tensor([[0, 5, 6, 11, 12], [7, 8, 9, 13, 0], [0, 5, 6, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 0, 0]])
    lay = packed.pack(ids, mask, 2)
    tokens = lay.input_ids[0].tolist()
    assert lay.n_tokens == 8 and lay.group[0] == lay.group[2] != lay.group[1]
    first = {g: lay.prompt_index[g][lay.prompt_valid[g]].tolist() for g in range(2)}
    # each distinct prompt once, then the responses' real tokens row by row
    assert [tokens[i] for i in first[int(lay.group[0])]] == [5, 6]
    assert [tokens[i] for i in first[int(lay.group[1])]] == [7, 8, 9]
    assert tokens[5:] == [11, 12, 13]
    # positions restart at 0 in each prompt and continue into each row's response
    pos = lay.position_ids[0].tolist()
    assert pos[5:] == [2, 3, 3]
    for g, index in first.items():
        assert [pos[i] for i in index] == list(range(len(index)))
    # response token 0 is predicted from the last prompt token, token 1 from response token 0
    g0 = int(lay.group[0])
    assert lay.logit_index[0].tolist() == [first[g0][-1], 5]
    assert lay.logit_index[1, 0] == first[int(lay.group[1])][-1]


def test_padding_of_another_form_falls_back_to_none():
    ids = torch.tensor([[5, 6, 11, 12]])
    assert packed.pack(ids, torch.tensor([[1, 0, 1, 1]]), 2) is None  # a hole in the prompt
    assert packed.pack(ids, torch.tensor([[1, 1, 0, 1]]), 2) is None  # a hole in the response
    assert packed.pack(ids, torch.tensor([[0, 0, 1, 1]]), 2) is None  # no prompt token at all


def test_a_grpo_batch_packs_to_distinct_prompt_tokens_plus_response_tokens():
    ids, mask, responses, rmask = grpo_batch(n_prompts=3, n=4)
    lay = packed.pack(ids, mask, responses.shape[1])
    prompt_tokens = int(mask[:, :-responses.shape[1]].sum()) // 4  # each prompt counted once
    assert lay.n_tokens == prompt_tokens + int(rmask.sum()) < mask.numel()


def test_repeated_rows_run_once_and_map_back_in_order_of_first_appearance():
    # rows 0 and 2 are the same (prompt ; response); row 3 repeats row 1
    ids = torch.tensor([[0, 5, 6, 11, 12], [7, 8, 9, 13, 0], [0, 5, 6, 11, 12], [7, 8, 9, 13, 0], [0, 5, 6, 14, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 1, 0]])
    lay = packed.pack(ids, mask, 2)
    assert lay.row_of.tolist() == [0, 1, 0, 1, 2]
    assert lay.n_tokens == 5 + 4  # prompts [5, 6] and [7, 8, 9] once; responses [11, 12], [13], [14] once
    tokens = lay.input_ids[0].tolist()
    assert [tokens[i] for i in lay.response_index[0].tolist()] == [11, 12]
    assert [tokens[i] for i in lay.response_index[2][:1].tolist()] == [14]


def test_a_grpo_batch_with_repeated_samples_packs_each_distinct_row_once():
    ids, mask, responses, rmask = grpo_batch(n_prompts=3, n=8, pool=2)
    lay = packed.pack(ids, mask, responses.shape[1])
    distinct = torch.unique(torch.where(mask.bool(), ids, -1), dim=0)
    assert lay.logit_index.shape[0] == len(distinct) <= 6 < len(ids)
    keep = [int((lay.row_of == d).nonzero()[0]) for d in range(len(distinct))]
    assert lay.n_tokens == int(mask[:, :-responses.shape[1]][::8].sum() + rmask[keep].sum())


@pytest.fixture(scope="module")
def models(model_dir):
    plain = load_causal_lm(model_dir).train()
    fast = load_causal_lm(model_dir, packed_forward=True).train()
    assert not packed.uses_packing(plain) and packed.uses_packing(fast)
    return plain, fast


@pytest.mark.parametrize("pool", [None, 2], ids=["distinct-rows", "repeated-rows"])
def test_log_probs_and_entropy_equal_the_padded_forward(models, pool):
    plain, fast = models
    ids, mask, responses, rmask = grpo_batch(n=8, seed=2, pool=pool)
    with torch.no_grad():
        lp, ent = local_model(plain).response_log_probs(ids, mask, responses, with_entropy=True, temperature=0.7)
        fast_lp, fast_ent = local_model(fast).response_log_probs(ids, mask, responses, with_entropy=True, temperature=0.7)
    real = rmask.bool()
    assert real.sum() > 20
    torch.testing.assert_close(fast_lp[real], lp[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_ent[real], ent[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pool", [None, 2], ids=["distinct-rows", "repeated-rows"])
def test_gradients_equal_the_padded_forward(models, pool):
    plain, fast = models
    ids, mask, responses, rmask = grpo_batch(seed=1, n=6, pool=pool)  # each row weighted differently below
    weights = torch.randn(rmask.shape, generator=torch.Generator().manual_seed(2)) * rmask
    grads = []
    for model in (plain, fast):
        model.zero_grad(set_to_none=True)
        lp, _ = local_model(model).response_log_probs(ids, mask, responses)
        (lp * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(grads[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_long_response_blocks_take_the_fused_kernel_and_still_equal_the_padded_forward(models, monkeypatch):
    """Responses of 40 tokens: the response block's scores (40 x 46) pass ``FUSED_CPU_MIN_SCORES``, so its attention
    runs the fused kernel while the prompt block's stays spelled out; log-probs and gradients are the padded
    forward's."""
    plain, fast = models
    ids, mask, responses, rmask = grpo_batch(n_prompts=2, n=3, seed=4, response_len=40)
    weights = torch.randn(rmask.shape, generator=torch.Generator().manual_seed(3)) * rmask
    fused = []
    real_sdpa, real_math = F.scaled_dot_product_attention, packed._math_attention
    grads = []
    for model in (plain, fast):
        if model is fast:  # the fused kernel, or with it off (the portable kernels) its math path written out
            monkeypatch.setattr(packed.F, "scaled_dot_product_attention",
                                lambda q, *a, **kw: (fused.append(q.shape[-2]), real_sdpa(q, *a, **kw))[1])
            monkeypatch.setattr(packed, "_math_attention",
                                lambda q, *a: (fused.append(q.shape[-2]), real_math(q, *a))[1])
        model.zero_grad(set_to_none=True)
        lp, _ = local_model(model).response_log_probs(ids, mask, responses)
        (lp * weights).sum().backward()
        grads.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert fused and set(fused) == {40}  # the response blocks, in every layer; not the prompts' 6 x 6
    real = rmask.bool()
    torch.testing.assert_close(grads[1][0][real], grads[0][0][real], atol=1e-5, rtol=1e-5)
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("name", ["padded", "packed"])
def test_each_forward_of_the_fast_model_equals_the_plain_hugging_face_forward(models, name, monkeypatch):
    """The reference is a plain HF model (transformers' own sdpa) through the padded forward. The model
    loaded for packing runs either forward behind the same interface: padded (its attention is then
    rlcore's hand-written CPU attention, ``small_attention``) or packed; both must agree at every real
    response token."""
    plain, fast = models
    ids, mask, responses, rmask = grpo_batch(n=4, seed=5, pool=2)
    calls = {"small": 0, "packed": 0}
    for fn, key in (("small_attention", "small"), ("packed_attention", "packed")):
        real_fn = getattr(packed, fn)
        monkeypatch.setattr(packed, fn, lambda *a, _f=real_fn, _k=key, **kw: (calls.__setitem__(_k, calls[_k] + 1),
                                                                               _f(*a, **kw))[1])
    with torch.no_grad():
        reference = FORWARDS.get("padded").response_logits(plain, ids, mask, responses.shape[1])
        assert calls == {"small": 0, "packed": 0}  # the reference runs transformers' own attention
        got = FORWARDS.get(name).response_logits(fast, ids, mask, responses.shape[1])
    assert calls["small" if name == "padded" else "packed"] == plain.config.num_hidden_layers
    real = rmask.bool()
    torch.testing.assert_close(got[real], reference[real], atol=1e-5, rtol=1e-5)


def test_the_packed_forward_really_runs_fewer_tokens(models, monkeypatch):
    _, fast = models
    seen = []
    embed = fast.get_input_embeddings()
    handle = embed.register_forward_hook(lambda mod, args, out: seen.append(args[0].numel()))
    try:
        ids, mask, responses, rmask = grpo_batch(n_prompts=3, n=4)
        with torch.no_grad():
            forward_for(fast).response_logits(fast, ids, mask, responses.shape[1])
    finally:
        handle.remove()
    assert seen == [packed.pack(ids, mask, responses.shape[1]).n_tokens]
    assert seen[0] < ids.numel() / 2


def test_critic_values_equal_the_padded_forward(model_dir):
    torch.manual_seed(0)
    plain = load_value_model(model_dir)
    torch.manual_seed(0)  # the same fresh value head
    fast = load_value_model(model_dir, packed_forward=True)
    assert packed.uses_packing(fast)
    ids, mask, responses, rmask = grpo_batch(seed=3, n=6, pool=2)
    with torch.no_grad():
        v = local_model(plain).response_values(ids, mask, responses.shape[1])
        fast_v = local_model(fast).response_values(ids, mask, responses.shape[1])
    real = rmask.bool()
    torch.testing.assert_close(fast_v[real], v[real], atol=1e-5, rtol=1e-5)


def test_generation_with_shared_prefill_matches_the_padded_model(models):
    plain, fast = models
    ids, mask, _, _ = grpo_batch(n_prompts=3, n=4)
    prompts, pmask = ids[:, :6], mask[:, :6]
    params = SamplingParams(max_new_tokens=5, greedy=True)
    outs = [HFRolloutEngine(m, eos_token_id=2, pad_token_id=PAD).generate(prompts, pmask, params)
            for m in (plain.eval(), fast.eval())]
    plain.train(), fast.train()
    assert torch.equal(outs[0]["responses"], outs[1]["responses"])
    torch.testing.assert_close(outs[1]["log_probs"], outs[0]["log_probs"], atol=1e-5, rtol=1e-5)
    # the sampled log-probs equal a training forward of the packed model over the finished rows
    rmask = outs[1]["response_mask"]
    with torch.no_grad():
        lp, _ = local_model(fast).response_log_probs(torch.cat([prompts, outs[1]["responses"]], 1),
                                   torch.cat([pmask, rmask], 1), outs[1]["responses"])
    torch.testing.assert_close(lp[rmask.bool()], outs[1]["log_probs"][rmask.bool()], atol=1e-5, rtol=1e-5)


def test_distinct_rows_maps_every_row_to_its_prompt():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [9, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    uniq, umask, row_of = distinct_rows(ids, mask)
    assert len(uniq) == 3
    assert torch.equal(uniq[row_of] * umask[row_of], ids * mask) and torch.equal(umask[row_of], mask)


@pytest.mark.parametrize("shape", [(16, 4, 40, 46), (3, 2, 5, 9)])
def test_the_written_out_math_path_gives_sdpas_bits_forward_and_backward(shape):
    """Long blocks with the fused CPU kernel off: ``_math_attention`` against ``scaled_dot_product_attention``'s own
    math path, every bit of the output and of the three gradients (masks as a packed response block has them: the
    prompt's first keys, then causal over the response)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    blocks, heads, tq, tk = shape
    g = torch.Generator().manual_seed(tq)
    q, k, v = (torch.randn(blocks, heads, t, 64, generator=g) for t in (tq, tk, tk))
    prompt = torch.randint(1, tk - tq + 1, (blocks, 1, 1, 1), generator=g)
    cols, rows = torch.arange(tk), torch.arange(tq)[:, None]
    allowed = (cols < prompt) | ((cols >= tk - tq) & (cols - (tk - tq) <= rows))
    grad = torch.randn(blocks, heads, tq, 64, generator=g)
    results = []
    for attend in (lambda *a: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3], scale=a[4]),
                   packed._math_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):
            out = attend(*leaves, allowed, 0.125)
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())


def test_small_attention_equals_sdpa_with_padding_rows():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 5, 8, generator=g) for _ in range(3))
    allowed = torch.ones(5, 5, dtype=torch.bool).tril().expand(3, 1, 5, 5).clone()
    allowed[0, :, :, :2] = False  # row 0 is left-padded by two: its first two queries see nothing
    out, _ = packed.small_attention(None, q, k, v, allowed, scaling=0.3)
    for b in range(3):
        for i in range(5):
            if not allowed[b, 0, i].any():
                continue
            keys = allowed[b, 0, i]
            expected = (F.softmax((q[b, :, i, None] @ k[b, :, keys].transpose(-1, -2)) * 0.3, -1) @ v[b, :, keys])[:, 0]
            torch.testing.assert_close(out[b, i], expected, atol=1e-6, rtol=1e-5)
    assert torch.isfinite(out).all()


def test_architectures_without_support_keep_their_attention(tmp_path, capsys):
    sliding = save_model(tmp_path / "sw", "qwen2", num_key_value_heads=4, use_sliding_window=True,
                         sliding_window=4, max_window_layers=0)
    assert attention_for(sliding, "sdpa", True) == "sdpa"
    assert "sliding-window" in capsys.readouterr().err
    assert packed.packing_supported(AutoConfig.for_model("gpt2")) is not None
    assert attention_for(sliding, "eager", True) == "eager"
