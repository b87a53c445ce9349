"""Tests for rlcore.workers.optim: the optimizer, its learning-rate schedule, and the clipped step that skips
non-finite steps."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from rlcore.engine.strategy import Replicated
from rlcore.workers.optim import OptimSpec, clipped_step, make_optimizer, update_metrics


def test_adamw_takes_the_multi_tensor_path_and_steps_like_the_single_tensor_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    plain.load_state_dict(model.state_dict())
    opt, _ = make_optimizer(model, OptimSpec(lr=0.1, weight_decay=0.01))
    reference = torch.optim.AdamW(plain.parameters(), lr=0.1, weight_decay=0.01, foreach=False)
    assert opt.param_groups[0]["foreach"] is True
    x = torch.randn(16, 4)
    for _ in range(3):
        for m, o in ((model, opt), (plain, reference)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    opt, sched = make_optimizer(torch.nn.Linear(2, 2), OptimSpec(lr=1.0, warmup_steps=2, total_steps=6,
                                                                   min_lr_ratio=0.1))
    lrs = []
    for _ in range(8):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    # warm-up 1/2, 2/2; then 0.1 + 0.9 * (1 + cos(pi * k / 4)) / 2 for k = 0..4, then the floor
    cosine = [0.1 + 0.9 * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(5)]
    expected = [0.5, 1.0] + cosine + [0.1]
    assert [round(x, 12) for x in lrs] == [round(x, 12) for x in expected]


def tiny_trainee(warmup_steps: int = 3):
    """A two-layer torch model as ``clipped_step`` sees a trained model (one rank, ddp), its AdamW with a
    warm-up (so the learning rate moves at every step the schedule counts), and a fixed input."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt, sched = make_optimizer(module, OptimSpec(lr=0.1, weight_decay=0.01, warmup_steps=warmup_steps))
    model = SimpleNamespace(module=module, strategy=Replicated(torch.device("cpu")))
    return model, opt, sched, torch.randn(16, 4)


def backward(model, x: torch.Tensor, poison: str | None = None) -> float:
    """Backward a squared-output loss and return it; ``poison`` makes one gradient element NaN or inf
    ("nan grad", "inf grad") or the returned loss non-finite ("nan loss", "inf loss")."""
    loss = model.module(x).square().mean()
    loss.backward()
    if poison in ("nan grad", "inf grad"):
        model.module[0].weight.grad[0, 0] = float(poison.split()[0])
    return float(poison.split()[0]) if poison in ("nan loss", "inf loss") else loss.item()


@pytest.mark.parametrize("poison", ["nan grad", "inf grad", "nan loss", "inf loss"])
def test_a_non_finite_loss_or_grad_norm_skips_the_step_and_leaves_no_trace(poison):
    model, opt, sched, x = tiny_trainee()
    backward(model, x)
    norm, skipped = clipped_step(model, opt, sched, 1.0, loss=1.0)  # a finite step first: AdamW has moments
    assert not skipped and math.isfinite(norm)
    weights = copy.deepcopy(model.module.state_dict())
    opt_state, lr, sched_steps = copy.deepcopy(opt.state_dict()), sched.get_last_lr(), sched.last_epoch

    loss = backward(model, x, poison)
    norm, skipped = clipped_step(model, opt, sched, 1.0, loss=loss)
    assert skipped
    assert math.isfinite(norm) == poison.endswith("loss")  # a loss-only problem still reports the real norm
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, weights[k]), k
    after = opt.state_dict()
    for i, state in opt_state["state"].items():
        for k, v in state.items():
            assert torch.equal(after["state"][i][k], v), (i, k)  # moments and step count
    assert (sched.get_last_lr(), sched.last_epoch) == (lr, sched_steps)
    assert all(p.grad is None for p in model.module.parameters())


def test_training_after_skipped_steps_is_the_training_without_them():
    """Finite, skipped, finite, skipped, finite equals the three finite steps alone: the same weights, the
    same AdamW state and the same warm-up learning rates at each applied step."""
    runs = {}
    for name, plan in (("with skips", [None, "nan grad", None, "inf loss", None]), ("without", [None] * 3)):
        model, opt, sched, x = tiny_trainee()
        lrs = []
        for poison in plan:
            lr = sched.get_last_lr()[0]
            loss = backward(model, x, poison)
            if not clipped_step(model, opt, sched, 1.0, loss=loss)[1]:
                lrs.append(lr)
        runs[name] = (model.module.state_dict(), lrs)
    (got, got_lrs), (want, want_lrs) = runs["with skips"], runs["without"]
    assert got_lrs == want_lrs == [pytest.approx(0.1 * k / 3) for k in (1, 2, 3)]
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_update_metrics_average_each_key_but_sum_the_skipped_steps():
    rows = [{"actor/grad_norm": 1.0, "actor/nonfinite_steps": 0.0},
            {"actor/grad_norm": 3.0, "actor/nonfinite_steps": 1.0},
            {"actor/grad_norm": 5.0, "actor/nonfinite_steps": 1.0}]
    assert update_metrics(rows, "actor") == {"actor/grad_norm": 3.0, "actor/nonfinite_steps": 2.0}
