"""What every GPU test module shares."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def float32_matmuls():
    """Full float32 matmuls (no TF32) for each GPU test module, restored afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)
