"""Fused elementwise operators of the decoder that give the bits of torch's eager ones (portable kernels only).

A Llama/Qwen MLP computes ``down(silu(gate(x)) * up(x))``. Eagerly, the SwiGLU in the middle is two passes over the
``[tokens, intermediate]`` activations forward (silu, mul) and three backward (two muls, silu_backward), and autograd
keeps ``silu(gate)`` as well as both inputs for the backward. Where rlcore's portable kernels run
(``resources.cpu_kernels: portable``, :mod:`rlcore.engine.portable_ops`), :func:`swiglu` is one pass each way
(``rlcore_portable::swiglu`` and ``swiglu_backward``) that keeps only the two inputs. Its kernels compute every
element with the expressions of torch's AVX2 loops (SLEEF's exp, the same roundings and fused multiply-add), so
the result is the eager one to the bit (tests/engine/test_fused.py checks the operators against torch's own and a
model's forward and gradients with and without): fusing changes the speed and the memory, not the numbers.

Everywhere else (native kernels, a GPU, other dtypes) :func:`swiglu` is the eager expression.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from rlcore.engine import portable_ops


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return torch.ops.rlcore_portable.swiglu(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return torch.ops.rlcore_portable.swiglu_backward(grad.contiguous(), gate, up)


def _fusable(gate: torch.Tensor, up: torch.Tensor) -> bool:
    return (portable_ops.installed() and not torch.compiler.is_compiling() and gate.device.type == "cpu"
            and gate.dtype == torch.float32 and up.dtype == torch.float32 and gate.shape == up.shape
            and gate.is_contiguous() and up.is_contiguous())


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: fused where the portable kernels run (the same bits), the eager expression elsewhere."""
    if _fusable(gate, up):
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return _SwiGLU.apply(gate, up)
        return torch.ops.rlcore_portable.swiglu(gate, up)
    return F.silu(gate) * up


def _swiglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _is_swiglu_mlp(module: torch.nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    projections = ("gate_proj", "up_proj", "down_proj")
    return (all(isinstance(getattr(module, name, None), torch.nn.Module) for name in projections)
            and (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"))


def use_fused_mlps(model: torch.nn.Module) -> int:
    """Route every Llama/Qwen-style SwiGLU MLP of ``model`` (``down(silu(gate(x)) * up(x))``) through
    :func:`swiglu`; returns how many. Safe for any model: other modules are left as they are."""
    found = 0
    for module in model.modules():
        if _is_swiglu_mlp(module):
            module.forward = types.MethodType(_swiglu_mlp_forward, module)
            found += 1
    return found
