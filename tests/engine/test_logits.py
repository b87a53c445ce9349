"""Tests for rlcore.engine.logits: the chunked log-prob and entropy equal the plain tensor expressions, values and
gradients, and keep nothing logits-sized for the backward but the logits themselves."""

from __future__ import annotations

import pytest
import torch

from rlcore.engine.logits import _blocks, sum_pi_squared, token_log_probs_and_entropy


def reference(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    """The textbook expressions: log_softmax then gather; ``-sum p log p`` with ``0 log 0 = 0``."""
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    p = log_p.exp()
    entropy = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(-1)
    return log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), entropy


def random_case(seed: int, shape=(3, 7), vocab=11, banned=0.2):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * 3
    ban = torch.rand(*shape, vocab, generator=g) < banned
    ban[..., 0] = False                                   # every position keeps a token it can sample
    tokens = torch.randint(0, vocab, shape, generator=g)
    ban.scatter_(-1, tokens.unsqueeze(-1), False)          # the sampled token was allowed
    return logits.masked_fill(ban, float("-inf")), tokens


@pytest.mark.parametrize("chunk_elements", [1, 11 * 5, 10**9])  # a row at a time; 5 rows, a remainder; one chunk
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_gradients_equal_the_plain_expressions(chunk_elements, temperature):
    logits, tokens = random_case(0)
    weights = torch.randn(2, *tokens.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    ours = logits.clone().requires_grad_()
    lp, ent = token_log_probs_and_entropy(ours, tokens, temperature, with_entropy=True, chunk_elements=chunk_elements)
    (weights[0] * lp + weights[1] * ent).sum().backward()

    ref = logits.clone().requires_grad_()
    ref_lp, ref_ent = reference(ref, tokens, temperature)
    (weights[0] * ref_lp + weights[1] * ref_ent).sum().backward()

    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(ours.grad).all()                # a banned token's gradient is 0, not nan
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-10, atol=1e-12)


def test_float32_log_probs_and_their_gradient_are_the_plain_expressions_bit_for_bit():
    """Each chunk runs the plain expressions' kernels, so an update without an entropy term is unchanged to the
    bit (what keeps dvc.lock reproducible across the change to the chunked form)."""
    logits, tokens = random_case(5, shape=(4, 9), vocab=13)
    logits = logits.float()
    ours = logits.clone().requires_grad_()
    lp, ent = token_log_probs_and_entropy(ours, tokens, 0.7, with_entropy=True, entropy_grad=False,
                                          chunk_elements=13 * 5)
    lp.sum().backward()
    plain = logits.clone().requires_grad_()
    z = plain.float() / 0.7
    plain_lp = torch.log_softmax(z, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    plain_lp.sum().backward()
    finite = torch.where(torch.isneginf(z), 0.0, z).detach()
    assert torch.equal(lp, plain_lp)
    assert torch.equal(ent, torch.logsumexp(z, -1).detach() - (torch.softmax(z, -1).detach() * finite).sum(-1))
    assert torch.equal(ours.grad, plain.grad)


def test_at_a_real_vocabulary_on_two_threads_log_probs_and_gradients_stay_bit_for_bit_and_the_entropy_within_rounding():
    """One-row chunks at a 40k vocabulary with two threads: the log-softmax and its backward still match the plain
    expressions to the bit (per row, however the rows are split), while a sum over the vocabulary may be reduced in
    another order than over the whole tensor (what the docstring says: within rounding, not always bit for bit)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(3)
        vocab = 40_000
        logits = torch.randn(5, vocab, generator=gen) * 3
        tokens = torch.randint(0, vocab, (5,), generator=gen)
        ours = logits.clone().requires_grad_()
        lp, ent = token_log_probs_and_entropy(ours, tokens, 0.7, with_entropy=True, entropy_grad=False,
                                              chunk_elements=vocab)
        lp.sum().backward()
        plain = logits.clone().requires_grad_()
        z = plain / 0.7
        plain_lp = torch.log_softmax(z, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        plain_lp.sum().backward()
        assert torch.equal(lp, plain_lp) and torch.equal(ours.grad, plain.grad)
        z = z.detach()
        lse = torch.logsumexp(z, -1)
        plain_ent = lse - (torch.softmax(z, -1) * z).sum(-1)
        # the entropy is a difference of two terms near 20 here (it is near 1): rounding shows at the terms' scale, so
        # a few of their float32 ulps (2 seen on an AMD EPYC with AVX-512, where rtol 1e-6 of the entropy failed)
        err = (ent - plain_ent).abs()
        assert (err <= 4 * torch.finfo(torch.float32).eps * lse.abs()).all(), (err, lse)
        from rlcore.algos.entropy import sum_pi_squared_from_logits

        torch.testing.assert_close(sum_pi_squared(logits, 0.7, chunk_elements=vocab), sum_pi_squared_from_logits(z),
                                   rtol=1e-6, atol=0)
    finally:
        torch.set_num_threads(threads)


def test_logits_whose_positions_are_not_one_view_are_read_in_place():
    """The padded forward hands over ``logits[:, :-1]`` (its last position dropped): rows of a wider tensor, which
    cannot be viewed as ``[positions, vocab]``; the results are the same as on a contiguous copy."""
    wide, tokens = random_case(6, shape=(3, 8), vocab=11)
    sliced = wide[:, :-1]
    assert not sliced.is_contiguous()
    ours = wide.clone().requires_grad_()
    lp, ent = token_log_probs_and_entropy(ours[:, :-1], tokens[:, :-1], 0.9, with_entropy=True, chunk_elements=11 * 3)
    (lp + 0.5 * ent).sum().backward()
    ref = wide.clone().requires_grad_()
    ref_lp, ref_ent = reference(ref[:, :-1], tokens[:, :-1], 0.9)
    (ref_lp + 0.5 * ref_ent).sum().backward()
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-10, atol=1e-12)
    assert (ours.grad[:, -1] == 0).all()


def test_chunks_cover_every_position_once_in_order_and_stay_within_their_size():
    wide = torch.arange(3 * 8 * 5, dtype=torch.float32).view(3, 8, 5)
    for logits in (wide, wide[:, :-1]):  # one view, and rows of a wider tensor
        blocks = list(_blocks(logits, 5 * 3))
        assert all(block.shape[0] <= 3 for _, block in blocks)
        assert [start for start, _ in blocks] == sorted(start for start, _ in blocks)
        assert torch.equal(torch.cat([block for _, block in blocks]), logits.reshape(-1, 5))


def test_the_outputs_are_the_callers_to_edit_in_place_and_mismatched_tokens_are_refused():
    logits, tokens = random_case(7, banned=0.0)
    z = logits.clone().requires_grad_()
    lp, ent = token_log_probs_and_entropy(z, tokens, with_entropy=True, entropy_grad=False)
    ent.masked_fill_(tokens == 0, 0.0)  # a logged statistic masked in place
    lp.mul_(1.0)
    lp.sum().backward()
    ref = logits.clone().requires_grad_()
    reference(ref, tokens, 1.0)[0].sum().backward()
    torch.testing.assert_close(z.grad, ref.grad, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"tokens \(3, 6\) do not match the logits' positions \(3, 7\)"):
        token_log_probs_and_entropy(logits, tokens[:, :-1])


def test_gradcheck_in_float64():
    logits, tokens = random_case(2, shape=(2, 3), vocab=5, banned=0.0)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda z: token_log_probs_and_entropy(z, tokens, 0.8, with_entropy=True, chunk_elements=10), (logits,))


def test_a_logged_only_entropy_has_no_gradient_and_leaves_the_log_prob_gradient_alone():
    logits, tokens = random_case(3)
    ours = logits.clone().requires_grad_()
    lp, ent = token_log_probs_and_entropy(ours, tokens, with_entropy=True, entropy_grad=False, chunk_elements=20)
    assert not ent.requires_grad and lp.requires_grad
    lp.sum().backward()
    ref = logits.clone().requires_grad_()
    reference(ref, tokens, 1.0)[0].sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-10, atol=1e-12)
    assert token_log_probs_and_entropy(logits, tokens)[1] is None


def test_bfloat16_logits_give_float32_statistics_and_a_bfloat16_gradient():
    logits, tokens = random_case(4, banned=0.0)
    half = logits.to(torch.bfloat16).requires_grad_()
    lp, ent = token_log_probs_and_entropy(half, tokens, with_entropy=True, chunk_elements=30)
    assert lp.dtype == ent.dtype == torch.float32
    (lp + ent).sum().backward()
    assert half.grad.dtype == torch.bfloat16
    exact = half.detach().double().requires_grad_()       # the same bfloat16 values, in float64
    ref_lp, ref_ent = reference(exact, tokens, 1.0)
    (ref_lp + ref_ent).sum().backward()
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(half.grad.double(), exact.grad, rtol=1e-2, atol=1e-3)


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for the backward while ``fn`` runs, each storage counted once."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_the_backward_keeps_only_the_logits_and_per_position_vectors():
    """On bfloat16 logits (an autocast forward's) the plain expressions save a float copy, the log-softmax and the
    probabilities, each 2x the logits' bytes; the chunked function saves the logits and two floats a position."""
    rows, vocab = 64, 4096
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, vocab, (rows,))

    def plain():
        z = logits.float()
        lp = torch.log_softmax(z, -1).gather(-1, tokens[:, None])
        p = torch.softmax(z, -1)
        return lp, torch.logsumexp(z, -1) - (p * z).sum(-1)

    ours = saved_bytes(lambda: token_log_probs_and_entropy(logits, tokens, with_entropy=True,
                                                            chunk_elements=vocab * 8))
    logits_bytes = rows * vocab * 2
    assert ours <= logits_bytes + rows * 8 * 2             # logits, tokens, entropy
    assert saved_bytes(plain) >= 3 * logits_bytes          # what it replaces: at least a float copy and more


@pytest.mark.parametrize("chunk_elements", [1, 13 * 5, 10**9])
def test_sum_pi_squared_in_chunks_is_the_whole_tensor_expression_bit_for_bit_and_the_textbook_sum(chunk_elements):
    """Against ``sum_v p_v^2`` in float64 (a banned token adds 0), and bit for bit against the expression on the
    whole float tensor it replaced in the optimal token baselines' forward; a padded ``[:, :-1]`` slice too."""
    logits, _ = random_case(7, shape=(4, 9), vocab=13)
    ours = sum_pi_squared(logits, 0.8, chunk_elements=chunk_elements)
    torch.testing.assert_close(ours, (torch.softmax(logits / 0.8, -1) ** 2).sum(-1), rtol=1e-12, atol=1e-14)
    low = logits.float()
    from rlcore.algos.entropy import sum_pi_squared_from_logits

    assert torch.equal(sum_pi_squared(low, 0.8, chunk_elements=chunk_elements), sum_pi_squared_from_logits(low / 0.8))
    wide = low[:, :-1]                                   # not one view: read a leading row at a time
    assert torch.equal(sum_pi_squared(wide, 1.0, chunk_elements=chunk_elements), sum_pi_squared_from_logits(wide))
    half = low.bfloat16()
    assert sum_pi_squared(half, chunk_elements=chunk_elements).dtype == torch.float32
    assert torch.equal(sum_pi_squared(half, chunk_elements=chunk_elements), sum_pi_squared_from_logits(half.float()))
