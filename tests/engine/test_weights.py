"""rlcore.engine.weights: policy weights through the object store as raw bytes, bit for bit."""

from __future__ import annotations

import torch

from rlcore.engine.weights import pack_state, unpack_state


def test_every_dtype_and_shape_comes_back_bit_for_bit(ray_local):
    state = {"w": torch.randn(3, 4), "half": torch.randn(5).to(torch.bfloat16), "count": torch.tensor(7),
             "transposed": torch.randn(2, 3).t(), "ids": torch.arange(6, dtype=torch.int64).view(2, 3)}
    back = unpack_state(ray_local.get(ray_local.put(pack_state(state))))
    assert back.keys() == state.keys()
    for k, v in state.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k], v), k
    model = torch.nn.Linear(4, 3)
    fresh = {"weight": torch.randn(3, 4), "bias": torch.randn(3)}
    model.load_state_dict(unpack_state(ray_local.get(ray_local.put(pack_state(fresh)))))  # copies out of the store
    assert torch.equal(model.weight.detach(), fresh["weight"])
