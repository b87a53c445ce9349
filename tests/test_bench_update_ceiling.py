"""bench.update_ceiling times the update's operators with OpTimes (torch.profiler makes the process fault its freed
memory in again, which inflated the ops that first write their outputs): it must see every operator call below
autograd, forward and backward, rlcore's own operators included, each call once and no time twice."""

from __future__ import annotations

import time

import torch

from bench.update_ceiling import MATMULS, OpTimes
from rlcore.engine import fused


def test_op_times_sees_every_call_forward_and_backward_once():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=gen, requires_grad=True)
    w_gate, w_up = (torch.randn(8, 32, generator=gen, requires_grad=True) for _ in range(2))
    with OpTimes() as timed:
        start = time.perf_counter()
        fused.swiglu(x @ w_gate, x @ w_up).sum().backward()
        wall = time.perf_counter() - start
    # two products forward; backward, each product's two gradients (of x and of the weight)
    assert sum(timed.calls.get(k, 0) for k in MATMULS) == 6
    assert timed.calls["rlcore_portable::swiglu"] == 1 and timed.calls["rlcore_portable::swiglu_backward"] == 1
    assert timed.seconds.keys() == timed.calls.keys()
    assert all(t > 0 for t in timed.seconds.values())
    assert sum(timed.seconds.values()) <= wall  # each call's own time: nothing counted twice
