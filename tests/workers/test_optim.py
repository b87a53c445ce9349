"""Tests for rlcore.workers.optim.make_optimizer."""

from __future__ import annotations

import torch

from rlcore.workers.optim import make_optimizer


def test_adamw_takes_the_multi_tensor_path_and_steps_like_the_single_tensor_one():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    plain.load_state_dict(model.state_dict())
    opt, _ = make_optimizer(model, lr=0.1, weight_decay=0.01, warmup_steps=0)
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
