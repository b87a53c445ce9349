"""Log-probs of sampled tokens and the entropy of each position, over vocabulary-sized logits, in chunks.

At a real vocabulary the logits are the largest tensor of an update: a micro-batch of 64 answers of 144 positions
over Qwen's 151,936 entries is 2.8 GB in bfloat16 and 5.6 GB in float32. Written as plain tensor operations, the
log-prob (``log_softmax(z.float() / T).gather``) and the entropy (``logsumexp(z) - sum softmax(z) z``) keep a float
copy, the log-softmax's output, the probabilities and their products for the backward, each logits-sized.
:func:`token_log_probs_and_entropy` is one autograd function that saves only the logits it is given (in their own
dtype) and the per-position entropy, and works ``chunk_elements`` at a time in both directions: the forward and
the backward each hold the logits, at most one logits-sized gradient, and a few chunk-sized float temporaries (the
backward recomputes each chunk's log-softmax).

The backward, per position with ``p = softmax(z / T)``, ``lp = log p(token)``, ``H = -sum p log p`` and upstream
gradients ``g`` (of ``lp``) and ``h`` (of ``H``)::

    dL/dz_v = (g * (1[v = token] - p_v) - h * p_v * (log p_v + H)) / T

(the second term is ``dH/dz_v``: ``-p_v (log p_v + H)``; at a ``-inf`` logit ``p_v = 0`` and it adds nothing).
Checked against the plain expressions and ``torch.autograd.gradcheck`` in tests/engine/test_logits.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

from rlcore.algos.entropy import sum_pi_squared_from_logits

# elements of a float chunk of logits (256 MiB in float32): a few of these are the function's only temporaries
CHUNK_ELEMENTS = 1 << 26


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision logits, their own dtype for float32/float64 ones."""
    return torch.promote_types(dtype, torch.float32)


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """A new float tensor ``chunk / temperature`` (never a view of the caller's logits)."""
    z = chunk.to(_compute_dtype(chunk.dtype), copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    return z


def _finite(z: torch.Tensor) -> torch.Tensor:
    """``z`` with ``-inf`` (a banned token, p = 0) replaced by 0, so ``p * z`` is 0 there instead of nan."""
    return torch.where(torch.isneginf(z), torch.zeros((), dtype=z.dtype, device=z.device), z)


def _blocks(logits: torch.Tensor, chunk_elements: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first flat position, [positions, vocab] view)`` over ``logits`` ``[..., vocab]`` a chunk at a time, in the
    order of ``logits.reshape(-1, vocab)``, without copying: where the leading dimensions cannot be viewed as one
    (the padded forward's ``logits[:, :-1]``) it goes over the first of them."""
    vocab = logits.shape[-1]
    try:
        flat = logits.view(-1, vocab)
    except RuntimeError:
        inner = math.prod(logits.shape[1:-1])
        for i in range(logits.shape[0]):
            for offset, block in _blocks(logits[i], chunk_elements):
                yield i * inner + offset, block
        return
    step = max(1, chunk_elements // max(vocab, 1))
    for start in range(0, flat.shape[0], step):
        yield start, flat[start:start + step]


class _TokenLogProbsAndEntropy(torch.autograd.Function):
    """Per chunk, the same kernels as the plain expressions (``log_softmax``, ``softmax``, ``logsumexp`` and the
    log-softmax's own backward), so a chunk's log-probs and log-prob gradients are those of the plain expressions
    bit for bit; only what is kept between the forward and the backward changes. The entropy's sums over the
    vocabulary are equal to within rounding, not always to the bit: a multi-threaded reduction over a chunk of a
    few rows splits each row's vocabulary across threads, where over the whole tensor it splits the rows (1 ulp on
    some positions at a 40k vocabulary, 2 threads, one-row chunks; tested). Each direction holds at most four
    chunk-sized float temporaries at a time."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, with_entropy, entropy_grad, chunk_elements):
        out_dtype = _compute_dtype(logits.dtype)
        log_probs = torch.empty(tokens.shape, dtype=out_dtype, device=logits.device)
        entropy = torch.empty(tokens.shape if with_entropy else (0,), dtype=out_dtype, device=logits.device)
        flat_lp, flat_ent, ids = log_probs.view(-1), entropy.view(-1), tokens.reshape(-1, 1)
        for start, block in _blocks(logits, chunk_elements):
            end = start + block.shape[0]
            z = _scaled(block, temperature)
            flat_lp[start:end] = torch.log_softmax(z, dim=-1).gather(-1, ids[start:end]).squeeze(-1)
            if with_entropy:
                weighted = torch.softmax(z, dim=-1).mul_(_finite(z))
                flat_ent[start:end] = torch.logsumexp(z, dim=-1) - weighted.sum(-1)
                del weighted
            del z
        differentiable_entropy = with_entropy and entropy_grad
        ctx.set_materialize_grads(False)  # an output nobody differentiates arrives as None, not zeros
        # the entropy is saved only when its gradient needs it: a logged-only entropy stays the caller's to edit
        ctx.save_for_backward(logits, tokens, entropy if differentiable_entropy else entropy.new_empty(0))
        ctx.temperature, ctx.entropy_grad, ctx.chunk_elements = temperature, differentiable_entropy, chunk_elements
        if not differentiable_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy):
        g_lp = grad_log_probs.reshape(-1, 1) if grad_log_probs is not None else None
        g_ent = grad_entropy.reshape(-1, 1) if (ctx.entropy_grad and grad_entropy is not None) else None
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None
        logits, tokens, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        ids, flat_ent = tokens.reshape(-1, 1), entropy.view(-1)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(-1, logits.shape[-1])
        for start, block in _blocks(logits, ctx.chunk_elements):
            end = start + block.shape[0]
            log_p = torch.log_softmax(_scaled(block, temperature), dim=-1)
            if g_lp is not None:   # gather's backward (a one-hot row), then the log-softmax's
                one_hot = torch.zeros_like(log_p).scatter_(-1, ids[start:end], g_lp[start:end].to(log_p.dtype))
                dz = torch._log_softmax_backward_data(one_hot, log_p, -1, log_p.dtype)
                del one_hot
            else:
                dz = torch.zeros_like(log_p)
            if g_ent is not None:  # dH/dz_v = -p_v (log p_v + H)
                term = _finite(log_p).add_(flat_ent[start:end, None]).mul_(log_p.exp_())
                dz.sub_(term.mul_(g_ent[start:end].to(term.dtype)))
                del term
            del log_p
            if temperature != 1.0:
                dz.div_(temperature)
            flat_grad[start:end] = dz
            del dz
        return grad, None, None, None, None, None


def token_log_probs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, *,
                                with_entropy: bool = False, entropy_grad: bool = True,
                                chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / T)[token]`` and, optionally, the entropy of ``softmax(logits / T)`` at each position.

    Args:
        logits: ``[..., vocab]`` in any float dtype (bfloat16 from an autocast forward stays bfloat16; no float
            copy of the whole tensor is made).
        tokens: ``[...]`` the token ids whose log-probs are wanted.
        temperature: the sampling temperature the logits are divided by.
        with_entropy: also return the entropy ``[...]`` (else None).
        entropy_grad: whether the entropy carries a gradient (False: logged only, the backward skips its term).
        chunk_elements: logits elements per chunk of the forward and the backward.

    Returns:
        ``(log_probs, entropy)``, each ``[...]`` in float32 (float64 for float64 logits).
    """
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(f"token_log_probs_and_entropy: tokens {tuple(tokens.shape)} do not match the logits' "
                         f"positions {tuple(logits.shape[:-1])} (logits {tuple(logits.shape)})")
    log_probs, entropy = _TokenLogProbsAndEntropy.apply(logits, tokens, float(temperature), with_entropy,
                                                         entropy_grad, int(chunk_elements))
    return log_probs, (entropy if with_entropy else None)


def sum_pi_squared(logits: torch.Tensor, temperature: float = 1.0, *,
                   chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """``sum_v softmax(logits / T)_v^2`` at each position (the optimal token baselines' input), a chunk at a time:
    each chunk is :func:`rlcore.algos.entropy.sum_pi_squared_from_logits` of its float copy, so the values are the
    whole-tensor expression's (to the bit on one thread; a sum over the vocabulary, so to within rounding where a
    multi-threaded reduction splits a few-row chunk differently, as :class:`_TokenLogProbsAndEntropy` says), and no
    logits-sized float temporary is made (that expression on the whole logits makes three: the float copy, twice
    it, its exponentials).

    Args:
        logits: ``[..., vocab]`` in any float dtype.
        temperature: the sampling temperature the logits are divided by.
        chunk_elements: logits elements per chunk.

    Returns:
        ``[...]`` in float32 (float64 for float64 logits), no gradient.
    """
    out = torch.empty(logits.shape[:-1], dtype=_compute_dtype(logits.dtype), device=logits.device)
    flat = out.view(-1)
    with torch.no_grad():
        for start, block in _blocks(logits, chunk_elements):
            flat[start:start + block.shape[0]] = sum_pi_squared_from_logits(_scaled(block, temperature))
    return out
