"""Tests for the parts of rlcore.workers.actor that need no Ray: the actor loss and the update.

The worker is built in this process, as a single rank with no process group; its loss is checked
against the same loss written out independently on a plain Hugging Face model.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from rlcore.algos.aggregation import AggScale
from rlcore.config import OffPolicyConfig, PolicyLossConfig
from rlcore.controller import RankPlacement
from rlcore.engine.model import ModelSpec, load_causal_lm
from rlcore.engine.sequence import sequences
from rlcore.protocol import Batch
from rlcore.rollout import EngineSpec
from rlcore.workers.actor import ActorRolloutRefWorker, ActorUpdateSpec, KLLossSpec
from rlcore.workers.optim import OptimSpec
from rlcore.workers.proximal import FirstForwardLogProbs, RecomputedLogProbs

# the default token-mean aggregation does not read the seq-mean-token-sum-norm divisor this length fills in
RESPONSE_LENGTH = 6
SPEC = ActorUpdateSpec(epochs=1, mini_batch_size=4, micro_batch_size=2, grad_clip=1.0, temperature=1.0,
                       loss=PolicyLossConfig().resolved(RESPONSE_LENGTH), entropy_coeff=0.0,
                       kl=KLLossSpec("low_var_kl", 0.001), seed=0, proximal=RecomputedLogProbs())


def actor_loss(worker, part: Batch, spec: ActorUpdateSpec, scale: AggScale):
    """The worker's micro-batch loss in the first mini-batch of an update of ``part`` alone."""
    measures = spec.proximal.measures(part, spec.off_policy, epochs=spec.epochs, mini_batch_size=spec.mini_batch_size)
    return worker._actor_loss(part, spec, scale, True, measures)


def test_sequences_drop_the_prompt_columns_that_no_row_uses():
    prompts = torch.tensor([[0, 0, 0, 5, 6], [0, 0, 7, 8, 9]])
    responses = torch.tensor([[10, 3, 0], [11, 12, 3]])
    batch = Batch({"prompts": prompts, "prompt_mask": (prompts != 0).long(),
                   "responses": responses, "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])})
    ids, mask = sequences(batch)
    assert ids.tolist() == [[0, 5, 6, 10, 3, 0], [7, 8, 9, 11, 12, 3]]
    assert mask.tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]


def fresh_worker(model_dir, lr: float = 0.05, packed: bool = True) -> ActorRolloutRefWorker:
    """A single-rank worker (no process group) with an actor, its optimizer, a rollout engine and a reference."""
    w = ActorRolloutRefWorker(RankPlacement(0, 1, torch.get_num_threads()),
                              model=ModelSpec(str(model_dir), packed_forward=packed), engine=EngineSpec(),
                              optim=OptimSpec(lr=lr), with_ref=True)
    w.init_model()
    return w


@pytest.fixture(scope="module")
def part(tiny_model_dir) -> Batch:
    """Four (prompt ; response) rows with PPO inputs: old and reference log-probs, advantages."""
    g = torch.Generator().manual_seed(0)
    vocab = load_causal_lm(tiny_model_dir).config.vocab_size
    prompts, responses = torch.randint(7, vocab, (4, 5), generator=g), torch.randint(7, vocab, (4, 3), generator=g)
    return Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts), "responses": responses,
                  "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]),
                  "old_log_probs": -3 - torch.rand(4, 3, generator=g),
                  "ref_log_probs": -3 - torch.rand(4, 3, generator=g), "advantages": torch.randn(4, 3, generator=g)})


def plain_loss(model, part: Batch, entropy_coeff: float, kl_coef: float):
    """The actor loss written out on a plain padded forward: token-mean PPO-clip (eps 0.2, dual clip 3),
    minus the entropy bonus, plus k3 KL to the reference; and the entropy alone."""
    ids = torch.cat([part["prompts"], part["responses"]], 1)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, 4:-1].float()
    logp_all = F.log_softmax(logits, -1)
    lp = logp_all.gather(-1, part["responses"][..., None])[..., 0]
    m = part["response_mask"].float()
    ratio = torch.exp(lp - part["old_log_probs"])
    a = part["advantages"]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    pg = torch.where(a < 0, torch.minimum(pg, -a * 3.0), pg)
    x = part["ref_log_probs"] - lp
    kl = torch.exp(x) - x - 1
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    mean = lambda t: (t * m).sum() / m.sum()  # noqa: E731
    return mean(pg) - entropy_coeff * mean(entropy) + kl_coef * mean(kl), mean(entropy)


@pytest.mark.parametrize("entropy_coeff", [0.0, 0.5])
def test_actor_loss_equals_the_loss_written_out_and_so_does_its_gradient(tiny_model_dir, part, entropy_coeff):
    worker = fresh_worker(tiny_model_dir)
    spec = dataclasses.replace(SPEC, entropy_coeff=entropy_coeff)
    scale = AggScale(tokens=float(part["response_mask"].sum()), rows=4.0, dp_size=1)
    result = actor_loss(worker, part, spec, scale)
    result.loss.backward()
    plain = load_causal_lm(tiny_model_dir)
    expected, entropy = plain_loss(plain, part, entropy_coeff, 0.001)
    expected.backward()
    assert result.loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert result.sums["actor/entropy"] == pytest.approx(entropy.item(), rel=1e-5)
    assert result.sums["actor/entropy"] > 0
    grads = dict(plain.named_parameters())
    for name, p in worker.actor.module.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-6, rtol=1e-4, msg=name)


def test_a_zero_entropy_coeff_keeps_the_entropy_off_the_backward_graph(tiny_model_dir, part):
    """The entropy is logged either way; with coefficient 0 no gradient path runs through it."""
    worker = fresh_worker(tiny_model_dir)
    seen = []
    import rlcore.engine.sequence as sequence_module

    real = sequence_module.token_log_probs_and_entropy

    def spy(*args, **kwargs):
        log_probs, entropy = real(*args, **kwargs)
        seen.append(entropy.requires_grad)
        return log_probs, entropy

    sequence_module.token_log_probs_and_entropy = spy
    try:
        scale = AggScale(tokens=float(part["response_mask"].sum()), rows=4.0, dp_size=1)
        actor_loss(worker, part, SPEC, scale)
        actor_loss(worker, part, dataclasses.replace(SPEC, entropy_coeff=0.5), scale)
    finally:
        sequence_module.token_log_probs_and_entropy = real
    assert seen == [False, True]


def test_update_computes_the_missing_reference_log_probs_exactly_as_the_controller_would(tiny_model_dir, part):
    given, computed = fresh_worker(tiny_model_dir), fresh_worker(tiny_model_dir)
    ref = load_causal_lm(tiny_model_dir).eval()  # an independent, plain copy of the reference
    ids, mask = sequences(part)
    with torch.no_grad():
        logits = ref(input_ids=ids, attention_mask=mask).logits[:, -4:-1].float()
        ref_lp = F.log_softmax(logits, -1).gather(-1, part["responses"][..., None])[..., 0]
    tensors = {k: v for k, v in part.tensors.items() if k != "ref_log_probs"}
    m_given = given.update_actor(Batch({**tensors, "ref_log_probs": ref_lp}), SPEC)
    m_computed = computed.update_actor(Batch(tensors), SPEC)
    assert m_computed["perf/ref_in_update_s"] > 0 and "perf/ref_in_update_s" not in m_given
    for key in ("actor/kl_loss", "actor/pg_loss", "actor/grad_norm", "actor/kl_ref"):
        assert m_computed[key] == pytest.approx(m_given[key], rel=1e-5, abs=1e-7), key
    rmask = part["response_mask"].float()
    expected_kl = ((part["old_log_probs"] - ref_lp) * rmask).sum() / rmask.sum()
    assert m_computed["actor/kl_ref"] == pytest.approx(float(expected_kl), rel=1e-5)
    for (name, a), b in zip(given.actor.module.named_parameters(), computed.actor.module.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)
    assert any(not torch.equal(a, r) for a, r in zip(given.actor.module.parameters(), ref.parameters()))


def test_one_update_in_micro_batches_is_one_plain_adamw_step_on_the_whole_loss(tiny_model_dir, part):
    """update_actor over 2 micro-batches of 2 rows = one AdamW step on the plain loss of all 4 rows
    (token-mean over the mini-batch, not a mean of micro-batch means: the rows have 3, 2, 1, 3 tokens),
    and its pg_loss metric is that loss's policy term."""
    lr = 0.01
    worker = fresh_worker(tiny_model_dir, lr=lr, packed=False)
    metrics = worker.update_actor(part, dataclasses.replace(SPEC, kl=None, seed=3))
    plain = load_causal_lm(tiny_model_dir)
    opt = torch.optim.AdamW(plain.parameters(), lr=lr, weight_decay=0.0)
    loss, _ = plain_loss(plain, part, 0.0, 0.0)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
    opt.step()
    assert metrics["actor/pg_loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert metrics["actor/grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
    trained = dict(plain.named_parameters())
    for name, p in worker.actor.module.named_parameters():
        torch.testing.assert_close(p, trained[name], atol=1e-6, rtol=1e-5, msg=name)
    assert not math.isnan(metrics["actor/pg_clipfrac"])


def test_a_mini_batch_with_an_infinite_advantage_is_skipped_and_the_other_one_trains(tiny_model_dir, part):
    """Two optimizer steps of two rows; an infinite advantage in one row makes its mini-batch's loss and
    gradient non-finite: that step is skipped and counted, and the weights end as one update on the other
    mini-batch's rows alone (the skipped step left no trace, whichever came first)."""
    spec = dataclasses.replace(SPEC, mini_batch_size=2, micro_batch_size=2, kl=None, seed=5)
    order = torch.randperm(4, generator=torch.Generator().manual_seed(spec.seed * 7919)).tolist()  # the shuffle
    bad, finite_rows = order[0], order[2:]  # the first mini-batch holds the bad row
    advantages = part["advantages"].clone()
    advantages[bad, 0] = math.inf
    skipping = fresh_worker(tiny_model_dir, lr=0.01, packed=False)
    metrics = skipping.update_actor(Batch({**part.tensors, "advantages": advantages}), spec)
    assert metrics["actor/nonfinite_steps"] == 1.0
    assert math.isnan(metrics["actor/grad_norm"])  # the mean over both steps: the skipped one's norm is NaN
    plain = fresh_worker(tiny_model_dir, lr=0.01, packed=False)
    finite = plain.update_actor(part.select(finite_rows), spec)
    assert finite["actor/nonfinite_steps"] == 0.0 and math.isfinite(finite["actor/grad_norm"])
    assert skipping.sched.last_epoch == plain.sched.last_epoch == 1
    moved = False
    for (name, got), want, start in zip(skipping.actor.module.named_parameters(), plain.actor.module.parameters(),
                                        load_causal_lm(tiny_model_dir).parameters()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)
        moved |= not torch.equal(got, start)
    assert moved


def plain_dro(model, part: Batch, old: torch.Tensor | None, weights, beta: float):
    """dro's loss written out on a plain padded forward, each token's loss times its off-policy weight, token-mean:
    ``weights(lp)`` gives the weights from the forward's log-probs (the fused path's proximal policy)."""
    ids = torch.cat([part["prompts"], part["responses"]], 1)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, 4:-1].float()
    lp = F.log_softmax(logits, -1).gather(-1, part["responses"][..., None])[..., 0]
    old = lp.detach() if old is None else old
    token = -(lp * part["advantages"] - 0.5 * beta * (lp - old) ** 2) * weights(lp.detach())
    m = part["response_mask"].float()
    return (token * m).sum() / m.sum()


def test_off_policy_weights_multiply_each_token_loss_given_or_taken_from_the_update_forward(tiny_model_dir, part):
    """``actor.off_policy`` on a loss that is not homogeneous in the advantage (dro): whether the old log-probs come
    with the batch (a trainer forward before the update) or are the update's own first forward, the update takes
    the TIS weights of them over ``rollout_log_probs`` and multiplies each token's loss by them, as written out
    here."""
    spec = dataclasses.replace(SPEC, loss=PolicyLossConfig(name="dro", dro_beta=0.4).resolved(RESPONSE_LENGTH), kl=None,
                               off_policy=OffPolicyConfig(correction="tis", cap=1.5))
    scale = AggScale(tokens=float(part["response_mask"].sum()), rows=4.0, dp_size=1)
    rollout = part["old_log_probs"] + 0.5  # a behaviour policy far enough off that TIS truncates some tokens
    with_rollout = part.union(Batch({"rollout_log_probs": rollout}))
    plain = load_causal_lm(tiny_model_dir)
    tis = lambda old: torch.exp(old - rollout).clamp(max=1.5) * part["response_mask"]  # noqa: E731

    given = actor_loss(fresh_worker(tiny_model_dir), with_rollout, spec, scale)
    expected = plain_dro(plain, part, part["old_log_probs"], lambda lp: tis(part["old_log_probs"]), 0.4)
    assert given.loss.item() == pytest.approx(expected.item(), abs=1e-6)
    unweighted = actor_loss(fresh_worker(tiny_model_dir), part, dataclasses.replace(spec, off_policy=None), scale)
    assert abs(unweighted.loss.item() - expected.item()) > 1e-3

    fused_part = Batch({k: v for k, v in with_rollout.tensors.items() if k != "old_log_probs"})
    fused = actor_loss(fresh_worker(tiny_model_dir), fused_part, dataclasses.replace(spec, proximal=FirstForwardLogProbs()), scale)
    expected = plain_dro(plain, part, None, tis, 0.4)
    assert fused.loss.item() == pytest.approx(expected.item(), abs=1e-6)
