"""The fused SwiGLU (rlcore/engine/fused.py, csrc/portable_kernels.cpp): torch's eager bits, one pass each way.

The reference is torch's own eager ``silu(g) * u`` and its autograd (ATen's AVX2 loops, which this process runs:
tests/conftest.py pins the portable kernels), not a copy of the fused code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlcore.engine import fused, portable_ops
from rlcore.engine.model import load_causal_lm
from rlcore.rollout import EngineSpec, make_engine
from rlcore.rollout import static
from rlcore.rollout.base import SamplingParams

pytestmark = pytest.mark.skipif(not portable_ops.installed(), reason="the portable kernels are not installed here")

ROTARY = torch.ops.rlcore_portable.rotary if portable_ops.installed() else None
SPECIAL = torch.tensor([0.0, -0.0, 88.7, -88.7, 104.0, -104.0, float("inf"), -float("inf"), 1e-30, -1e-30, 20.0, -20.0])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) & (a.signbit() == b.signbit()) | (a.isnan() & b.isnan())).all())


def eager(g, u, grad):
    g, u = g.clone().requires_grad_(), u.clone().requires_grad_()
    y = F.silu(g) * u
    y.backward(grad)
    return y.detach(), g.grad, u.grad


# sizes: whole vector pairs (16 floats), and tails of 1-15 that torch's loop computes with the scalar expression
@pytest.mark.parametrize("shape", [(64, 1, 1024), (3, 333), (17,), (5,), (1000003,)])
@pytest.mark.parametrize("scale", [1.0, 12.0])
def test_the_fused_operators_give_the_eager_bits(shape, scale):
    gen = torch.Generator().manual_seed(sum(shape))
    g, u, grad = (torch.randn(shape, generator=gen) for _ in range(3))
    g = g * scale
    flat = g.view(-1)
    flat[: min(len(SPECIAL), flat.numel())] = SPECIAL[: flat.numel()]
    y, dg, du = eager(g, u, grad)
    assert same_bits(torch.ops.rlcore_portable.swiglu(g, u), y)
    fdg, fdu = torch.ops.rlcore_portable.swiglu_backward(grad, g, u)
    assert same_bits(fdg, dg) and same_bits(fdu, du)
    # and through the autograd function the MLPs call
    gg, uu = g.clone().requires_grad_(), u.clone().requires_grad_()
    out = fused.swiglu(gg, uu)
    out.backward(grad)
    assert same_bits(out.detach(), y) and same_bits(gg.grad, dg) and same_bits(uu.grad, du)


def test_other_inputs_take_the_eager_expression():
    g, u = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    assert torch.equal(fused.swiglu(g, u), F.silu(g) * u)
    g32 = torch.randn(8, 4).T  # not contiguous
    assert not fused._fusable(g32, g32.contiguous())
    assert torch.equal(fused.swiglu(g32, g32), F.silu(g32) * g32)
    x, cos = torch.randn(2, 3, 5, 8), torch.randn(1, 1, 5, 8)
    assert fused._rotary_fusable(x, cos, cos)
    assert not fused._rotary_fusable(x, torch.randn(1, 1, 4, 8), cos)  # does not broadcast: eager says why
    assert not fused._rotary_fusable(x, cos.requires_grad_(), cos)  # a gradient for cos: eager computes it


def rotary_operands(shape, seed):
    """x as attention holds it (heads and tokens transposed, not contiguous), cos and sin of positions 0.. (sin(0) is
    0: products of +-0), a gradient with zeros of both signs."""
    b, h, t, d = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, d, generator=gen).transpose(1, 2)
    freqs = torch.arange(t, dtype=torch.float32)[:, None] * (10000.0 ** (-torch.arange(d // 2) / (d // 2)))[None]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    grad = torch.randn(b, h, t, d, generator=gen)
    grad[..., ::7] = 0.0
    grad[..., 3::7] = -0.0
    return x, cos, sin, grad


@pytest.mark.parametrize("shape", [(1, 4, 37, 64), (3, 2, 5, 16)])
def test_the_fused_rotary_embedding_gives_the_eager_bits(shape):
    x, cos, sin, grad = rotary_operands(shape, seed=shape[2])
    half = shape[-1] // 2
    xe = x.clone().requires_grad_()
    ye = xe * cos + torch.cat((-xe[..., half:], xe[..., :half]), -1) * sin  # Hugging Face's apply_rotary_pos_emb
    ye.backward(grad)
    assert same_bits(torch.ops.rlcore_portable.rotary(x, cos, sin), ye.detach())
    assert same_bits(torch.ops.rlcore_portable.rotary_backward(grad, cos, sin), xe.grad)
    xf = x.clone().requires_grad_()
    yf = fused.rotate(xf, cos, sin)
    yf.backward(grad)
    assert same_bits(yf.detach(), ye.detach()) and same_bits(xf.grad, xe.grad)
    assert yf.stride() == ye.stride()  # the layout the eager loops give, for the ops after it


def test_a_model_gives_the_same_logits_and_gradients_fused_or_not(tiny_model_dir, monkeypatch):
    model = load_causal_lm(tiny_model_dir, packed_forward=True).train()
    layers = model.config.num_hidden_layers
    assert sum(isinstance(m.__dict__.get("forward"), type(model.forward)) for m in model.modules()) == layers
    ids = torch.randint(3, model.config.vocab_size, (6, 20), generator=torch.Generator().manual_seed(0))
    results, calls = [], []
    monkeypatch.setattr(torch.ops.rlcore_portable, "rotary", lambda *a: calls.append(1) or ROTARY(*a), raising=False)
    for unfused in (False, True):
        if unfused:
            monkeypatch.setattr(fused, "_fusable", lambda gate, up: False)
            monkeypatch.setattr(fused, "_rotary_fusable", lambda x, cos, sin: False)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        torch.log_softmax(logits, -1)[..., 5].sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
        if not unfused:
            assert len(calls) == 2 * layers  # every query and key rotated by the fused kernel
    (la, ga), (lb, gb) = results
    assert same_bits(la, lb)
    assert ga.keys() == gb.keys() and all(same_bits(ga[n], gb[n]) for n in ga)


def test_the_static_engine_samples_the_same_tokens_fused_or_not(tiny_model_dir, monkeypatch):
    model = load_causal_lm(tiny_model_dir).eval()
    engine = make_engine(model, EngineSpec("static"), eos_token_id=-1, pad_token_id=0)
    writes = [0]
    monkeypatch.setattr(static, "write_cache", lambda *a: writes.__setitem__(0, writes[0] + 1) or fused.write_cache(*a))
    ids = torch.randint(3, model.config.vocab_size, (24, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[::3, :2] = 0
    params = SamplingParams(max_new_tokens=12)
    a = engine.generate(ids * mask, mask, params, torch.Generator().manual_seed(5))
    monkeypatch.setattr(fused, "_fusable", lambda gate, up: False)
    monkeypatch.setattr(fused, "_rotary_fusable", lambda x, cos, sin: False)
    monkeypatch.setattr(static, "direct_cache_writes", lambda cache: False)  # index_copy_ into the caches
    b = engine.generate(ids * mask, mask, params, torch.Generator().manual_seed(5))
    assert torch.equal(a["responses"], b["responses"]) and same_bits(a["log_probs"], b["log_probs"])
    assert writes == [2 * model.config.num_hidden_layers * (params.max_new_tokens - 1)]  # keys and values, each step


def test_cache_writes_put_each_row_at_its_position_and_nothing_else():
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(6, 2, 9, 8, generator=gen)
    src = torch.randn(4, 2, 3, 8, generator=gen)[:, :, 1]  # [rows, heads, d] from a [rows, heads, tokens, d] view
    pos = torch.tensor([0, 8, 3, 3])
    want = cache.clone()
    want[torch.arange(4)[:, None], torch.arange(2)[None, :], pos[:, None]] = src
    fused.write_cache(cache, src, pos)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="position 9 of row 1 outside the cache's 9"):
        fused.write_cache(cache, src, torch.tensor([0, 9, 0, 0]))
    assert torch.equal(cache, want)  # checked before anything is written
