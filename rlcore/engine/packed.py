"""Packed forwards: every distinct prompt once, every distinct row once, no padding tokens.

A PPO/GRPO batch repeats each prompt ``n`` times (one row per sampled response) and pads
prompts and responses to fixed widths. The plain forward therefore runs the same prompt
tokens ``n`` times and every padding token too; and a confident policy samples the same
response several times in a group (about 45% of the rows of a bench step on the arithmetic
task), each of which the plain forward runs again. Here the rows are packed into one sequence
of real tokens: each distinct prompt once, then the real tokens of each distinct
(prompt ; response) row once; the outputs are gathered back to every input row, so gradients
from repeated rows add up in the one computation they share. Attention is computed per block,
so a response attends to the tokens of its own prompt and its own earlier tokens, exactly as
in the padded forward:

* prompt block ``[prompts, prompt_len]``: causal attention within each distinct prompt;
* response block ``[distinct rows, response_len]``: keys are the row's prompt (the shared keys
  and values, gathered by index, so gradients from all its rows add up in them) followed by
  the row's own response, causally.

The linear layers, norms and MLPs (nearly all the FLOPs) see only the packed tokens. This is
the same computation as the padded forward up to float summation order, which the tests check
against the plain model. It works through the Hugging Face attention interface, so the model,
its FSDP wrapping and its weights are unchanged: the model is loaded with ``ATTN_NAME``, which
behaves like ``sdpa`` unless a forward passes a ``PackedLayout`` (on CPU, short attentions are
computed with explicit matmuls, see ``small_attention``).

``model.packed_forward`` (default true) turns this on for the actor, reference and critic
forwards and for the rollout engine's model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_NAME = "rlcore_packed_sdpa"
# Decoders whose attention is plain causal softmax attention over rotary q/k through the
# attention interface (no sliding window, soft-capping or sinks): packing is exact for them.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3"})


@dataclass
class PackedLayout:
    """Index tensors that map a padded ``[rows, prompt_len + response_len]`` batch to one packed
    sequence of ``n_tokens`` real tokens and back. Built by ``pack``; see the module docstring."""

    input_ids: torch.Tensor  # [1, n_tokens]
    position_ids: torch.Tensor  # [1, n_tokens]
    prompt_index: torch.Tensor  # [prompts, prompt_len] packed position of each prompt token (0 where padding)
    prompt_valid: torch.Tensor  # [prompts, prompt_len] bool
    response_index: torch.Tensor  # [distinct rows, response_len] packed position of each response token (0: padding)
    group: torch.Tensor  # [distinct rows] which distinct prompt each distinct row has
    prompt_attn: torch.Tensor  # [prompts, 1, prompt_len, prompt_len] bool: may attend
    response_attn: torch.Tensor  # [distinct rows, 1, response_len, prompt_len + response_len] bool
    unpack_index: torch.Tensor  # [n_tokens] each packed token's place in the flattened (prompt ; response) blocks
    logit_index: torch.Tensor  # [distinct rows, response_len] packed position whose output predicts each response token
    row_of: torch.Tensor  # [rows] each input row's distinct row (identical rows run once)

    @property
    def n_tokens(self) -> int:
        return self.input_ids.shape[1]


def _lengths_if_contiguous(mask: torch.Tensor, *, left: bool) -> torch.Tensor | None:
    """Per-row counts of a mask that is a contiguous run at the right (``left`` padding) or at the
    left (right padding) of every row; None if some row is not of that form."""
    n = mask.sum(1)
    cols = torch.arange(mask.shape[1], device=mask.device)
    expected = cols[None, :] >= (mask.shape[1] - n)[:, None] if left else cols[None, :] < n[:, None]
    return n if torch.equal(expected, mask.bool()) else None


def _causal(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int) -> PackedLayout | None:
    """Packed layout of a ``[rows, prompt_len + response_len]`` batch (prompts left-padded, responses
    right-padded); None if the padding is not of that form (the caller then runs the plain forward)."""
    device = input_ids.device
    prompt_ids, resp_ids = input_ids[:, :-response_len], input_ids[:, -response_len:]
    prompt_mask, resp_mask = attention_mask[:, :-response_len].bool(), attention_mask[:, -response_len:].bool()
    if prompt_ids.shape[1] == 0:
        return None
    if _lengths_if_contiguous(prompt_mask, left=True) is None:
        return None
    resp_lens = _lengths_if_contiguous(resp_mask, left=False)
    if resp_lens is None:
        return None

    # distinct rows: identical (prompt ; response) rows get the same log-probs, so each runs once
    keyed_rows = torch.cat([torch.where(prompt_mask, prompt_ids, -1), torch.where(resp_mask, resp_ids, -1)], 1)
    row_of, keep = _distinct_in_order(keyed_rows)
    prompt_ids, resp_ids, prompt_mask, resp_mask, resp_lens = (
        t[keep] for t in (prompt_ids, resp_ids, prompt_mask, resp_mask, resp_lens))

    # distinct prompts of the distinct rows (padding marked -1 so it is part of the key), left-aligned;
    # from here on "rows" are the distinct rows
    keyed = torch.where(prompt_mask, prompt_ids, -1)
    distinct, group = torch.unique(keyed, dim=0, return_inverse=True)
    distinct_mask = distinct >= 0
    prompt_lens = distinct_mask.sum(1)
    if int(prompt_lens.min()) == 0:
        return None  # a row without a prompt token: nothing for its first response token to attend to
    n_prompts, lp = distinct.shape[0], int(prompt_lens.max())
    rows, lr = resp_ids.shape[0], response_len

    prompt_tokens = distinct[distinct_mask]  # row-major: prompt by prompt, in order
    resp_tokens = resp_ids[resp_mask]
    n_prompt_tokens = prompt_tokens.shape[0]
    prompt_start = torch.cumsum(prompt_lens, 0) - prompt_lens
    resp_start = n_prompt_tokens + torch.cumsum(resp_lens, 0) - resp_lens

    jp = torch.arange(lp, device=device)
    jr = torch.arange(lr, device=device)
    prompt_valid = jp[None, :] < prompt_lens[:, None]
    resp_valid = jr[None, :] < resp_lens[:, None]
    prompt_index = torch.where(prompt_valid, prompt_start[:, None] + jp[None, :], 0)
    response_index = torch.where(resp_valid, resp_start[:, None] + jr[None, :], 0)

    positions = torch.cat([jp[None, :].expand(n_prompts, lp)[prompt_valid],
                           (prompt_lens[group][:, None] + jr[None, :])[resp_valid]])
    # where each packed token sits in cat(prompt block.flatten(), response block.flatten())
    unpack_index = torch.cat([(torch.arange(n_prompts, device=device)[:, None] * lp + jp[None, :])[prompt_valid],
                              n_prompts * lp + (torch.arange(rows, device=device)[:, None] * lr + jr[None, :])[resp_valid]])

    # a padding query row attends to everything (its output is never used; this keeps softmax finite)
    prompt_attn = (_causal(lp, device)[None] & prompt_valid[:, None, :]) | ~prompt_valid[:, :, None]
    resp_self = (_causal(lr, device)[None] & resp_valid[:, None, :])
    response_attn = torch.cat([prompt_valid[group][:, None, :].expand(rows, lr, lp), resp_self], dim=2)
    response_attn = response_attn | ~resp_valid[:, :, None]

    # response token 0 is predicted from the last prompt token, token j > 0 from response token j - 1
    last_prompt = prompt_start + prompt_lens - 1
    logit_index = torch.cat([last_prompt[group][:, None], response_index[:, :-1]], dim=1)
    logit_index = torch.where(resp_valid, logit_index, 0)

    return PackedLayout(
        input_ids=torch.cat([prompt_tokens, resp_tokens])[None], position_ids=positions[None],
        prompt_index=prompt_index, prompt_valid=prompt_valid, response_index=response_index, group=group,
        prompt_attn=prompt_attn[:, None], response_attn=response_attn[:, None], unpack_index=unpack_index,
        logit_index=logit_index, row_of=row_of)


def _distinct_in_order(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``[rows, width]`` keys: each row's distinct-row index, distinct rows numbered in order of
    first appearance (``[rows]``), and the row where each distinct row first appears (``[distinct]``).
    Without repeats both are ``arange(rows)``."""
    distinct, inverse = torch.unique(keys, dim=0, return_inverse=True)
    rows = torch.arange(keys.shape[0], device=keys.device)
    first = torch.full((distinct.shape[0],), keys.shape[0], dtype=torch.long, device=keys.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.shape[0], device=keys.device)
    return rank[inverse], first[order]


# Score matrices (q_len x k_len) from which the fused CPU kernel beats the arithmetic spelled out. CPU seconds of one
# forward + backward of 128 blocks x 4 heads (1 thread, medians of 9): 6 x 22: 11.6 ms spelled out / 15.5 fused;
# 32 x 48: 25.3 / 18.5; 50 x 66 (the long-answer bench): 90 / 64; 100 x 116: 301 / 158.
FUSED_CPU_MIN_SCORES = 1024


def _block_attention(q, k, v, allowed, scale):
    """Softmax attention of ``[blocks, heads, q_len, d]`` queries over ``[blocks, heads, k_len, d]``
    keys/values where ``allowed`` (``[blocks, 1, q_len, k_len]``).

    On a GPU, and on the CPU for long blocks (``FUSED_CPU_MIN_SCORES``), the fused kernel of
    ``scaled_dot_product_attention`` (masked); on a CPU with that kernel off (the portable kernels), its math path
    written out (``_math_attention``: the same bits). On the CPU for short ones, plain matmuls and a softmax written
    out: at a few dozen keys ATen's softmax kernels and the fused CPU attention kernel are slower than the same
    arithmetic spelled out (``make bench`` profiles; ``tests/engine/test_packed.py`` checks the result).
    """
    if q.device.type != "cpu" or q.shape[-2] * k.shape[-2] >= FUSED_CPU_MIN_SCORES:
        if q.device.type == "cpu" and q.dtype == torch.float32 and not torch.backends.cuda.flash_sdp_enabled():
            return _math_attention(q, k, v, allowed, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    # every row allows at least one key, so the max is finite; the shift is a constant for autograd
    e = (scores - scores.amax(-1, keepdim=True).detach()).exp()
    return torch.matmul(e / e.sum(-1, keepdim=True), v)


def _math_attention(q, k, v, allowed, scale):
    """``scaled_dot_product_attention``'s math path (what it runs on a CPU with its fused kernel off, as the portable
    kernels have it), op for op, so the same bits forward and backward; less its check for rows with no allowed key
    (``_safe_softmax``'s, ~1 ms a layer at the long answers' blocks), which packed blocks never have."""
    s = math.sqrt(scale)  # q and k each scaled by the root of the scale, as the math path does
    scores = torch.matmul(q * s, k.transpose(-2, -1) * s)
    scores.add_(torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(allowed.logical_not(), float("-inf")))
    return torch.matmul(torch.softmax(scores, -1), v)


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                     layout: PackedLayout, **kwargs):
    """Blockwise attention over a packed sequence; q/k/v ``[1, heads, n_tokens, head_dim]``, returns
    ``[1, n_tokens, heads, head_dim]`` as the Hugging Face attention interface expects."""
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        raise ValueError("packed forward: sliding-window attention is not supported; set model.packed_forward: false")
    if dropout:
        raise ValueError("packed forward: attention dropout is not supported; set model.packed_forward: false")
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:  # grouped-query attention: one key/value head per n_rep query heads
        key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    heads, d = query.shape[1], query.shape[3]
    # [1, heads, n, d] -> [n, heads, d]: gather tokens along dim 0
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    pi, ri = layout.prompt_index, layout.response_index

    def blocks(t, index):  # [n, heads, d] -> [blocks, heads, len, d]
        return t.index_select(0, index.reshape(-1)).view(*index.shape, heads, d).transpose(1, 2)

    qp, kp, vp = blocks(q, pi), blocks(k, pi), blocks(v, pi)
    qr, kr, vr = blocks(q, ri), blocks(k, ri), blocks(v, ri)
    op = _block_attention(qp, kp, vp, layout.prompt_attn, scale)
    # each row's keys: its prompt's (shared, so gradients from every row add up there), then its own
    kr = torch.cat([kp.index_select(0, layout.group), kr], dim=2)
    vr = torch.cat([vp.index_select(0, layout.group), vr], dim=2)
    orr = _block_attention(qr, kr, vr, layout.response_attn, scale)
    out = torch.cat([op.transpose(1, 2).reshape(-1, heads, d), orr.transpose(1, 2).reshape(-1, heads, d)])
    return out.index_select(0, layout.unpack_index)[None], None


def small_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention for short key lengths on CPU (decode steps, short training sequences):
    ``[batch, heads, q, d]`` queries, a boolean ``[batch, 1, q, k]`` mask. Same result as ``sdpa``."""
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    allowed = attention_mask[..., : key.shape[2]]
    allowed = allowed | ~allowed.any(-1, keepdim=True)  # a padding query row: any finite output will do
    return _block_attention(query, key, value, allowed, scale).transpose(1, 2).contiguous(), None


# Above this many keys the fused kernel wins again (and an explicit score matrix costs memory).
SMALL_ATTENTION_MAX_KEYS = 256


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    layout = kwargs.pop("rlcore_layout", None)
    if layout is not None:
        return packed_attention(module, query, key, value, attention_mask, scaling, dropout, layout=layout, **kwargs)
    if (query.device.type == "cpu" and not dropout and not kwargs.get("sliding_window")
            and isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
            and key.shape[2] <= SMALL_ATTENTION_MAX_KEYS):
        return small_attention(module, query, key, value, attention_mask, scaling)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


def register() -> str:
    """Make ``ATTN_NAME`` known to transformers' attention interfaces (again: harmless); returns it.

    Called before a model is loaded with it (``rlcore.engine.model.attention_for``), not at import: the interfaces
    live in ``transformers.modeling_utils``, whose import (torch.distributed.tensor, torch._dynamo, scipy: seconds)
    a process that loads no model (a stage's controller, the ``rlcore`` command) does without."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_NAME, _attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME

# A prepared 4D mask makes the model skip building its own; the layout carries the real masks.
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


def packing_supported(config) -> str | None:
    """None if forwards of this model config can be packed, else why not (one line)."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()) or getattr(config, "use_sliding_window", False):
        return "the model uses sliding-window attention"
    return None


def uses_packing(model) -> bool:
    """Whether ``model`` was loaded for packed forwards (``rlcore.engine.model.load_causal_lm``)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == ATTN_NAME


def _forward(model, layout: PackedLayout, **kwargs):
    return model(input_ids=layout.input_ids, attention_mask=_NO_MASK.to(layout.input_ids.device),
                 position_ids=layout.position_ids, use_cache=False, rlcore_layout=layout, **kwargs)


def packed_response_logits(model, layout: PackedLayout) -> torch.Tensor:
    """Logits predicting each response token, ``[rows, response_len, vocab]``; at padding positions
    they are some real token's logits (mask them, as with the padded forward)."""
    out = _forward(model, layout, logits_to_keep=layout.logit_index.reshape(-1))
    return out.logits[0].view(*layout.logit_index.shape, -1)[layout.row_of]


def packed_values(value_model, layout: PackedLayout) -> torch.Tensor:
    """Token-classification outputs (critic values) at the states before each response token,
    ``[rows, response_len]``."""
    out = _forward(value_model, layout)
    return out.logits[0, layout.logit_index, 0][layout.row_of]
