"""Tests for the parts of rlcore.workers.actor that need no Ray: sequences and the actor loss.

The loss tests build the worker in this process and give it an unsharded model: ``_actor_loss``
only runs forwards through ``self.actor``.
"""

from __future__ import annotations

import pytest
import torch

from rlcore.algos.losses import entropy_from_logits
from rlcore.engine import logprob
from rlcore.engine.model import load_causal_lm
from rlcore.protocol import Batch
from rlcore.workers import actor
from rlcore.workers.actor import ActorRolloutRefWorker, sequences

LOSS_CFG = {"temperature": 1.0, "loss_agg_mode": "token-mean", "policy_loss": "vanilla", "clip_ratio": 0.2,
            "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio_c": 3.0, "use_kl_loss": True,
            "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.001}


def test_sequences_drop_the_prompt_columns_that_no_row_uses():
    prompts = torch.tensor([[0, 0, 0, 5, 6], [0, 0, 7, 8, 9]])
    responses = torch.tensor([[10, 3, 0], [11, 12, 3]])
    batch = Batch({"prompts": prompts, "prompt_mask": (prompts != 0).long(),
                   "responses": responses, "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])})
    ids, mask = sequences(batch)
    assert ids.tolist() == [[0, 5, 6, 10, 3, 0], [7, 8, 9, 11, 12, 3]]
    assert mask.tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]


@pytest.fixture(scope="module")
def worker(tiny_model_dir) -> ActorRolloutRefWorker:
    w = ActorRolloutRefWorker(0, 1, torch.get_num_threads(), model_path=str(tiny_model_dir), roles=("actor",))
    w.actor = load_causal_lm(tiny_model_dir).train()
    return w


@pytest.fixture(scope="module")
def part(worker) -> Batch:
    """Four (prompt ; response) rows with PPO inputs: old and reference log-probs, advantages."""
    g = torch.Generator().manual_seed(0)
    vocab = worker.actor.config.vocab_size
    prompts, responses = torch.randint(7, vocab, (4, 5), generator=g), torch.randint(7, vocab, (4, 3), generator=g)
    return Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts), "responses": responses,
                  "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]),
                  "old_log_probs": -3 - torch.rand(4, 3, generator=g),
                  "ref_log_probs": -3 - torch.rand(4, 3, generator=g), "advantages": torch.randn(4, 3, generator=g)})


def loss_and_grads(worker, part: Batch, entropy_coeff: float):
    worker.actor.zero_grad(set_to_none=True)
    loss, metrics = worker._actor_loss(part, {**LOSS_CFG, "entropy_coeff": entropy_coeff})
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in worker.actor.named_parameters()}, metrics


def test_a_zero_entropy_coeff_keeps_the_entropy_off_the_graph_and_changes_nothing_else(worker, part, monkeypatch):
    on_graph = []

    def spy(logits: torch.Tensor) -> torch.Tensor:
        on_graph.append(logits.requires_grad)
        return entropy_from_logits(logits)

    monkeypatch.setattr(logprob, "entropy_from_logits", spy)
    loss, grads, metrics = loss_and_grads(worker, part, 0.0)
    # As before: the entropy on the graph, in the loss times 0.
    monkeypatch.setattr(actor, "response_log_probs",
                        lambda *a, **kw: logprob.response_log_probs(*a, **{**kw, "entropy_grad": True}))
    old_loss, old_grads, old_metrics = loss_and_grads(worker, part, 0.0)
    assert on_graph == [False, True]
    assert torch.equal(loss, old_loss)
    assert metrics == old_metrics and metrics["actor/entropy"] > 0
    for name, g in grads.items():
        assert torch.equal(g, old_grads[name]), name


def test_an_entropy_bonus_still_reaches_the_gradient(worker, part):
    _, plain, plain_metrics = loss_and_grads(worker, part, 0.0)
    _, bonus, bonus_metrics = loss_and_grads(worker, part, 0.5)
    assert bonus_metrics["actor/entropy"] == plain_metrics["actor/entropy"]
    assert not torch.equal(bonus["lm_head.weight"], plain["lm_head.weight"])


def fresh_worker(model_dir) -> ActorRolloutRefWorker:
    """A single-rank worker (no process group) with an actor, its optimizer and a reference."""
    w = ActorRolloutRefWorker(0, 1, torch.get_num_threads(), model_path=str(model_dir), roles=("actor", "ref"),
                              packed_forward=True, optim={"lr": 0.05, "weight_decay": 0.0, "warmup_steps": 0})
    w.init_model()
    return w


def test_update_computes_the_missing_reference_log_probs_exactly_as_the_controller_would(tiny_model_dir, part):
    update_cfg = {**LOSS_CFG, "entropy_coeff": 0.0, "ppo_epochs": 1, "mini_batch_size": 4, "micro_batch_size": 2,
                  "grad_clip": 1.0}
    given, computed = fresh_worker(tiny_model_dir), fresh_worker(tiny_model_dir)
    ref = load_causal_lm(tiny_model_dir).eval()  # an independent, plain copy of the reference
    ids, mask = sequences(part)
    with torch.no_grad():
        ref_lp, _ = logprob.response_log_probs(ref, ids, mask, part["responses"])
    tensors = {k: v for k, v in part.tensors.items() if k != "ref_log_probs"}
    with_ref = Batch({**tensors, "ref_log_probs": ref_lp}, meta={"actor": update_cfg, "seed": 0})
    without = Batch(tensors, meta={"actor": update_cfg, "seed": 0})
    m_given = given.update_actor(with_ref).meta["metrics"]
    m_computed = computed.update_actor(without).meta["metrics"]
    assert m_computed["perf/ref_in_update_s"] > 0 and "perf/ref_in_update_s" not in m_given
    for key in ("actor/kl_loss", "actor/pg_loss", "actor/grad_norm", "actor/kl_ref"):
        assert m_computed[key] == pytest.approx(m_given[key], rel=1e-5, abs=1e-7), key
    rmask = part["response_mask"].float()
    expected_kl = ((part["old_log_probs"] - ref_lp) * rmask).sum() / rmask.sum()
    assert m_computed["actor/kl_ref"] == pytest.approx(float(expected_kl), rel=1e-5)
    for (name, a), b in zip(given.actor.named_parameters(), computed.actor.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)
    assert any(not torch.equal(a, r) for a, r in zip(given.actor.parameters(), ref.parameters()))
