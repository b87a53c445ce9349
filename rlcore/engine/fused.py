"""Fused elementwise operators of the decoder that give the bits of torch's eager ones (portable kernels only).

SwiGLU. A Llama/Qwen MLP computes ``down(silu(gate(x)) * up(x))``. Eagerly, the SwiGLU in the middle is two passes
over the ``[tokens, intermediate]`` activations forward (silu, mul) and three backward (two muls, silu_backward), and
autograd keeps ``silu(gate)`` as well as both inputs for the backward. Where rlcore's portable kernels run
(``resources.cpu_kernels: portable``, :mod:`rlcore.engine.portable_ops`), :func:`swiglu` is one pass each way
(``rlcore_portable::swiglu`` and ``swiglu_backward``) that keeps only the two inputs. Its kernels compute every
element with the expressions of torch's AVX2 loops (SLEEF's exp, the same roundings and fused multiply-add), so
the result is the eager one to the bit (tests/engine/test_fused.py checks the operators against torch's own and a
model's forward and gradients with and without): fusing changes the speed and the memory, not the numbers.

Rotary embedding. Attention rotates each query and key, ``x cos + rotate_half(x) sin``: five eager passes forward
(mul, neg, cat, mul, add) and, backward, two products, a negation and two zero-filled slice gradients that autograd
adds up. :func:`rotate` is one pass each way (``rlcore_portable::rotary``, ``rotary_backward``) with every product and
sum rounded on its own, as eagerly; the backward's sum is autograd's, including its sign of zero (the kernel's
comment says why).

KV cache writes. A decode step writes each row's new key and value at the row's own position of its cache slot;
:func:`write_cache` does that as one copy per (row, head) (``rlcore_portable::cache_write``) where torch's
``index_copy_`` cost more than the step's attention at a few dozen positions. A copy: the same values either way.

Everywhere else (native kernels, a GPU, other dtypes, under ``torch.compile``) they are the eager expressions.
:func:`use_fused_ops` routes a Hugging Face model's MLPs and rotary embedding through them; rlcore's model loaders
call it, and the static rollout engine calls them directly.
"""

from __future__ import annotations

import sys
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


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return torch.ops.rlcore_portable.rotary(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return torch.ops.rlcore_portable.rotary_backward(grad, cos, sin), None, None


def _broadcasts_to(t: torch.Tensor, shape: torch.Size) -> bool:
    return t.dim() == len(shape) and t.shape[-1] == shape[-1] and all(a in (1, b) for a, b in zip(t.shape, shape))


def _rotary_fusable(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    return (portable_ops.installed() and not torch.compiler.is_compiling() and x.device.type == "cpu"
            and x.dtype == cos.dtype == sin.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] % 2 == 0
            and not cos.requires_grad and not sin.requires_grad
            and _broadcasts_to(cos, x.shape) and _broadcasts_to(sin, x.shape))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` (``cos``, ``sin`` broadcast to ``x``): fused where the portable kernels run (the
    same bits), the eager expression elsewhere."""
    if _rotary_fusable(x, cos, sin):
        if torch.is_grad_enabled() and x.requires_grad:
            return _Rotary.apply(x, cos, sin)
        return torch.ops.rlcore_portable.rotary(x, cos, sin)
    return (x * cos) + (_rotate_half(x) * sin)


def _apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Hugging Face's ``apply_rotary_pos_emb`` (Llama, Qwen2, Qwen3) through :func:`rotate`."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return rotate(q, cos, sin), rotate(k, cos, sin)


ROTARY_MODULES = ("transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
                  "transformers.models.qwen3.modeling_qwen3")
"""The modeling modules whose ``apply_rotary_pos_emb`` is the expression :func:`rotate` computes."""


def use_fused_ops(model: torch.nn.Module) -> int:
    """Route every Llama/Qwen-style SwiGLU MLP of ``model`` (``down(silu(gate(x)) * up(x))``) through :func:`swiglu`
    and, for a Llama/Qwen2/Qwen3 model, the rotary embedding of its modeling module through :func:`rotate`; returns
    how many MLPs. Safe for any model: other modules are left as they are."""
    found = 0
    for module in model.modules():
        if _is_swiglu_mlp(module):
            module.forward = types.MethodType(_swiglu_mlp_forward, module)
            found += 1
        name = type(module).__module__
        if name in ROTARY_MODULES and getattr(sys.modules[name], "apply_rotary_pos_emb", None) is not None:
            sys.modules[name].apply_rotary_pos_emb = _apply_rotary_pos_emb
    return found


def direct_cache_writes(cache: torch.Tensor) -> bool:
    """Whether :func:`write_cache` copies into ``cache`` itself (the portable kernels, on CPU, outside
    ``torch.compile``); otherwise the caller writes with torch's own indexing."""
    return (portable_ops.installed() and not torch.compiler.is_compiling() and cache.device.type == "cpu"
            and cache.dim() == 4 and cache.stride(-1) == 1)


def write_cache(cache: torch.Tensor, src: torch.Tensor, pos: torch.Tensor) -> None:
    """``cache[i, h, pos[i]] = src[i, h]`` for every row ``i`` of ``src [rows, heads, d]`` and head ``h`` of
    ``cache [slots, heads, length, d]`` (only where :func:`direct_cache_writes`)."""
    torch.ops.rlcore_portable.cache_write(cache, src, pos)
