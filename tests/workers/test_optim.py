"""Tests for rlcore.workers.optim: the optimizer and its learning-rate schedule."""

from __future__ import annotations

import math

import torch

from rlcore.workers.optim import OptimSpec, make_optimizer


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
