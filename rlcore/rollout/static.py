"""A generation engine with a preallocated KV cache, compacted batches and, on a GPU, CUDA graphs.

The Hugging Face token loop (``rlcore.rollout.hf``) spends most of a decode step in Python:
module calls, a growing ``DynamicCache`` re-concatenated every token, attention masks rebuilt
from scratch. This engine runs the same decoder (Llama and Qwen2 layouts) as a lean functional
forward over the model's own parameters:

* **static KV cache**: ``[slots, kv_heads, max_len, head_dim]`` per layer, allocated once for the
  largest batch seen; each row's prompt starts at cache index 0, so a row's cache index is its
  position id and the keys it may attend to are simply ``index <= position``;
* **prefill once per distinct prompt**: the ``n`` rows of a group share a prompt; its keys and
  values are computed once and copied to every row;
* **compaction**: when rows finish (EOS), the rows still running are moved to the front of the
  cache as soon as they fit a smaller batch bucket, so finished rows stop costing work;
* **compiled decode step** (``compile=True``): ``torch.compile`` of one decode step per bucket;
* **CUDA graphs** (on a GPU, ``cuda_graphs=True``): each bucket's decode step is captured once and
  replayed; weights are updated in place (``load_weights`` copies into the same tensors), so a
  training step never triggers a recapture or a recompilation.

Sampling, EOS tracking and the sampled tokens' log-probs are those of the HF engine
(``rlcore.rollout.sampling``); the random stream is drawn for every row of the original batch at
every step, so with bitwise-equal logits the two engines sample the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from rlcore.engine.fused import direct_cache_writes, rotate, swiglu, write_cache
from rlcore.engine.lora import is_peft
from rlcore.rollout.base import CachedPrefix, SamplingParams, WeightRefresh, load_into
from rlcore.rollout.sampling import distinct_rows, filter_logits, row_uniforms, sample_from
from rlcore.rollout.turns import Trajectories

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


# the modules a LoRA adapter may sit on for this engine (peft's 'all-linear' on Llama/Qwen2 is exactly these)
LORA_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def adapter_reason(model) -> str | None:
    """Why this engine cannot run the adapters of a peft ``model`` (None: it can, or there are none)."""
    if not is_peft(model):
        return None
    targets = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
    if targets - LORA_MODULES:
        return f"LoRA on {', '.join(sorted(targets - LORA_MODULES))} (only on {', '.join(sorted(LORA_MODULES))})"
    if any(len(m.active_adapters) != 1 for m in model.modules() if hasattr(m, "lora_A")):
        return "more than one active LoRA adapter"
    return None


def unsupported_reason(config) -> str | None:
    """Why this engine cannot run a model of ``config`` (None: it can)."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    rope = getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) in ("dynamic", "longrope"):
        return f"rope_scaling {rope.get('rope_type', rope.get('type'))!r} (position-dependent frequencies)"
    return None


def buckets_for(batch: int) -> list[int]:
    """Batch sizes a decode step runs at: powers of two below ``batch``, and ``batch`` itself."""
    sizes, b = [batch], 1
    while b < batch:
        sizes.append(b)
        b *= 2
    return sorted(set(sizes))


def bucket_of(n: int, sizes: list[int]) -> int:
    """The smallest bucket that holds ``n`` rows."""
    return next(s for s in sizes if s >= n)


@dataclass
class _Linear:
    """A projection's weight and bias and, for a LoRA layer, its adapter: ``x W^T + b + s (x A^T) B^T``, peft's
    unmerged forward (so a weight sync moves only A and B, copied into these very tensors)."""

    w: torch.Tensor
    b: torch.Tensor | None = None
    lora_a: torch.Tensor | None = None  # [rank, in]
    lora_b: torch.Tensor | None = None  # [out, rank]
    scale: float = 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.w, self.b)
        if self.lora_a is None:
            return y
        return y + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


def _linear_of(module) -> _Linear:
    """The :class:`_Linear` of an ``nn.Linear`` or of a peft LoRA layer over one (its one active adapter)."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return _Linear(module.weight, module.bias)
    (name,) = module.active_adapters
    return _Linear(base.weight, base.bias, module.lora_A[name].weight, module.lora_B[name].weight,
                   float(module.scaling[name]))


@dataclass
class _Layer:
    ln1: torch.Tensor
    q: _Linear
    k: _Linear
    v: _Linear
    o: _Linear
    ln2: torch.Tensor
    gate: _Linear
    up: _Linear
    down: _Linear


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama/Qwen2 RMSNorm: normalised in float32, cast back, then scaled."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class Decoder:
    """The forward of a Llama/Qwen2 causal LM over a static KV cache, reading the HF model's own
    parameters (so ``model.load_state_dict`` updates it in place)."""

    def __init__(self, model):
        cfg = model.config
        self.model = model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.max_positions = cfg.max_position_embeddings
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(_Layer(
                layer.input_layernorm.weight, _linear_of(a.q_proj), _linear_of(a.k_proj), _linear_of(a.v_proj),
                _linear_of(a.o_proj), layer.post_attention_layernorm.weight, _linear_of(m.gate_proj),
                _linear_of(m.up_proj), _linear_of(m.down_proj)))
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[length, head_dim]`` for positions ``0..length-1``, as the HF rotary embedding
        computes them (float32 products and cos/sin, times the attention scaling, cast to the dtype)."""
        key = (length, self.dtype, self.device)
        if key not in self._rope:
            pos = torch.arange(length, device=self.device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq.float()[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            # kept for the life of the decoder: captured CUDA graphs read these very tensors
            self._rope[key] = ((emb.cos() * self.attention_scaling).to(self.dtype),
                               (emb.sin() * self.attention_scaling).to(self.dtype))
        return self._rope[key]

    def new_cache(self, slots: int, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (slots, self.n_kv, length, self.head_dim)
        return ([torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers],
                [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers])

    def _attention_block(self, x, lay: _Layer, cos, sin):
        b, t, _ = x.shape
        h = _rms_norm(x, lay.ln1, self.eps)
        q = lay.q(h).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = lay.k(h).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = lay.v(h).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def _finish_layer(self, x, attn, lay: _Layer):
        b, _, t, _ = attn.shape
        x = x + lay.o(attn.transpose(1, 2).reshape(b, t, -1))
        h = _rms_norm(x, lay.ln2, self.eps)
        return x + lay.down(swiglu(lay.gate(h), lay.up(h)))

    def _attend(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                              enable_gqa=self.n_kv != self.n_heads)

    def _hidden(self, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, list, list]:
        """Right-padded sequences ``ids [p, t]`` of ``lengths``: the last layer's outputs ``[p, t, hidden]`` and every
        layer's keys and values ``[p, kv_heads, t, head_dim]``."""
        p, t = ids.shape
        cos, sin = self.rope_tables(t)
        cos, sin = cos[None, None], sin[None, None]
        cols = torch.arange(t, device=ids.device)
        causal = cols[None, :] <= cols[:, None]
        mask = (causal[None] & (cols[None, None, :] < lengths[:, None, None]))[:, None]  # [p, 1, t, t]
        x = F.embedding(ids, self.embed)
        keys, values = [], []
        for lay in self.layers:
            q, k, v = self._attention_block(x, lay, cos, sin)
            keys.append(k)
            values.append(v)
            x = self._finish_layer(x, self._attend(q, k, v, mask), lay)
        return x, keys, values

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, list, list]:
        """Right-padded prompts ``ids [p, t]`` of ``lengths``: the logits after each prompt's last token
        ``[p, vocab]`` (float32) and every layer's keys and values ``[p, kv_heads, t, head_dim]``."""
        x, keys, values = self._hidden(ids, lengths)
        last = x[torch.arange(ids.shape[0], device=ids.device), lengths - 1]
        return F.linear(_rms_norm(last, self.norm, self.eps), self.lm_head).float(), keys, values

    def logits(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Right-padded sequences ``ids [p, t]`` of ``lengths``: the next-token logits at every position
        ``[p, t, vocab]`` (float32; any value past a sequence's end)."""
        x, _, _ = self._hidden(ids, lengths)
        return F.linear(_rms_norm(x, self.norm, self.eps), self.lm_head).float()

    def decode(self, tokens: torch.Tensor, pos: torch.Tensor, k_cache: list[torch.Tensor],
               v_cache: list[torch.Tensor], attend: int | None = None) -> torch.Tensor:
        """One token per row: ``tokens [b]`` at positions ``pos [b]``; writes their keys and values at
        ``pos`` in the first ``b`` cache slots, attends to cache indices ``<= pos`` and returns the
        next-token logits ``[b, vocab]`` (float32).

        ``attend=None``: attention over the whole cache with SDPA; every shape is fixed per ``b``, so the
        step compiles and captures as is. ``attend=n`` (eager): only the first ``n`` cache indices
        (``n > pos.max()``), with batched matmuls, which beat SDPA's kernels for one query on a CPU."""
        b = tokens.shape[0]
        length = k_cache[0].shape[2] if attend is None else attend
        cos_t, sin_t = self.rope_tables(k_cache[0].shape[2])
        cos, sin = cos_t[pos][:, None, None], sin_t[pos][:, None, None]  # [b, 1, 1, d]
        valid = torch.arange(length, device=pos.device)[None, :] <= pos[:, None]  # [b, len]
        if attend is None:
            mask = valid[:, None, None]
        else:  # additive mask [b * kv_heads, 1, len] for baddbmm over (row, kv head) pairs
            groups = self.n_heads // self.n_kv
            bias = torch.zeros(valid.shape, dtype=self.dtype, device=pos.device).masked_fill_(~valid, float("-inf"))
            bias = bias[:, None, None].expand(b, self.n_kv, 1, length).reshape(b * self.n_kv, 1, length)
        # row i's key and value of kv head h go to (i, h, pos[i]) of the caches: one copy per (row, head) where the
        # portable kernels run; otherwise one index_copy_ of b * kv rows per cache seen as [slots * kv * len, d]
        # (advanced-index assignment took ~90 us a layer at 64 rows on a CPU)
        direct = direct_cache_writes(k_cache[0])
        if not direct:
            heads = torch.arange(self.n_kv, device=pos.device)
            at = ((torch.arange(b, device=pos.device)[:, None] * self.n_kv + heads[None, :]) * k_cache[0].shape[2]
                  + pos[:, None]).reshape(-1)
        x = F.embedding(tokens[:, None], self.embed)
        for lay, kc, vc in zip(self.layers, k_cache, v_cache):
            q, k, v = self._attention_block(x, lay, cos, sin)
            if direct:
                write_cache(kc, k[:, :, 0], pos)
                write_cache(vc, v[:, :, 0], pos)
            else:
                kc.view(-1, self.head_dim).index_copy_(0, at, k.reshape(b * self.n_kv, self.head_dim))
                vc.view(-1, self.head_dim).index_copy_(0, at, v.reshape(b * self.n_kv, self.head_dim))
            if attend is None:
                attn = self._attend(q, kc[:b], vc[:b], mask)
            else:
                keys = kc[:b, :, :length].reshape(b * self.n_kv, length, self.head_dim)
                vals = vc[:b, :, :length].reshape(b * self.n_kv, length, self.head_dim)
                scores = torch.baddbmm(bias, q.reshape(b * self.n_kv, groups, self.head_dim), keys.transpose(1, 2),
                                       alpha=self.scale)
                attn = torch.bmm(scores.softmax(-1), vals).view(b, self.n_heads, 1, self.head_dim)
            x = self._finish_layer(x, attn, lay)
        return F.linear(_rms_norm(x[:, 0], self.norm, self.eps), self.lm_head).float()


    def extend(self, ids: torch.Tensor, lengths: torch.Tensor, start: torch.Tensor, slots: torch.Tensor,
               k_cache: list[torch.Tensor], v_cache: list[torch.Tensor]) -> torch.Tensor:
        """Continue rows from their caches (a chunked prefill): row ``i`` of the right-padded ``ids [p, t]`` holds
        ``lengths[i]`` new tokens for cache slot ``slots[i]``, at positions ``start[i]`` on; their keys and values
        are written there and they attend to the slot's cache up to themselves. Returns the logits after each row's
        last new token ``[p, vocab]`` (float32). Padding columns write to the cache's last index, which no row
        uses (the caller keeps it free)."""
        p, t = ids.shape
        last_index = k_cache[0].shape[2] - 1
        cols = torch.arange(t, device=ids.device)
        pos = start[:, None] + cols[None, :]  # [p, t]
        write = torch.where(cols[None, :] < lengths[:, None], pos, last_index)
        attend = int((start + lengths).max())
        cos_t, sin_t = self.rope_tables(k_cache[0].shape[2])
        cos, sin = cos_t[write][:, None], sin_t[write][:, None]  # [p, 1, t, d]
        mask = (torch.arange(attend, device=ids.device)[None, None, :] <= pos[:, :, None])[:, None]  # [p, 1, t, len]
        first = int(slots[0])
        # slots first..first+p-1 (every row of the batch, not compacted): attend to a view of them, not a copy
        span = slice(first, first + p) if bool((slots == first + torch.arange(p, device=slots.device)).all()) else None
        x = F.embedding(ids, self.embed)
        for lay, kc, vc in zip(self.layers, k_cache, v_cache):
            q, k, v = self._attention_block(x, lay, cos, sin)
            kc[slots[:, None], :, write] = k.transpose(1, 2)
            vc[slots[:, None], :, write] = v.transpose(1, 2)
            keys, values = (kc[span, :, :attend], vc[span, :, :attend]) if span else \
                (kc[slots, :, :attend], vc[slots, :, :attend])
            x = self._finish_layer(x, self._attend(q, keys, values, mask), lay)
        last = x[torch.arange(p, device=ids.device), lengths - 1]
        return F.linear(_rms_norm(last, self.norm, self.eps), self.lm_head).float()


class _GraphedStep:
    """One bucket's decode step captured in a CUDA graph over static inputs and outputs."""

    def __init__(self, step, size: int, k_cache, v_cache, device, pool=None):
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        # the warm-up steps write keys and values at the cache's last index: no row ever holds a live
        # entry there (a row's last decode step writes at most at prompt + max_new_tokens - 2)
        self.pos = torch.full((size,), k_cache[0].shape[2] - 1, dtype=torch.long, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up runs (lazy inits, compilation) outside the capture
            for _ in range(2):
                step(self.tokens, self.pos, k_cache, v_cache)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = step(self.tokens, self.pos, k_cache, v_cache)

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.pos.copy_(pos)
        self.graph.replay()
        return self.logits


class StaticRolloutEngine:
    """Generates with its own copy of the policy (an HF Llama/Qwen2 model), refreshed by ``load_weights``."""

    takes_weights_mid_generation = True
    """:meth:`generate` takes a ``refresh`` (partial rollouts): no other engine does."""
    reuses_prefixes = True
    """:meth:`generate` takes ``prefixes`` and ``keep_prefixes`` (:class:`~rlcore.rollout.base.CachedPrefix`)."""

    def __init__(self, model, *, eos_token_id: int, pad_token_id: int, compile: bool = False,
                 cuda_graphs: bool = True):
        """``model``: an HF causal LM, or a peft model over one (its adapters run unmerged). Only its tensors are read
        (never its forward), so it may be the very model a trainer updates in place: generation then always runs
        the current weights with no copy (``rlcore.workers.rollout.make_trainer_engine``)."""
        reason = unsupported_reason(model.config) or adapter_reason(model)
        if reason:
            raise ValueError(f"static rollout engine: {reason}")
        self.model = model
        self.decoder = Decoder(model.get_base_model() if hasattr(model, "get_base_model") else model)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.use_graphs = cuda_graphs and self.decoder.device.type == "cuda"
        self.compiled = compile
        self.step_fn = torch.compile(self.decoder.decode, dynamic=False, fullgraph=True) if compile \
            else self.decoder.decode
        self.cache: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        self.graphs: dict[int, _GraphedStep] = {}
        self.graph_pool = None
        self.stats = {"compactions": 0, "graph_captures": 0, "decode_rows": 0, "decode_steps": 0, "extends": 0,
                      "refills": 0, "prefix_tokens": 0}
        self.weights_loaded = 0  # load_weights calls: a CachedPrefix of other weights is not used

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        # load_state_dict copies into the existing tensors: compiled steps and graphs keep reading them
        load_into(self.model, state_dict)
        self.weights_loaded += 1

    @torch.inference_mode()
    def log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, responses: torch.Tensor
                  ) -> torch.Tensor:
        """The decoder's own forward over (prompt ; response), right-aligned as the prefill runs it."""
        width, resp_len = input_ids.shape[1], responses.shape[1]
        lengths = attention_mask.long().sum(-1)
        cols = torch.arange(width + resp_len, device=input_ids.device)
        src = (width - lengths)[:, None] + cols[None, :]  # left-padded prompt, then the response: shift left
        full = torch.cat([input_ids, responses], dim=1)
        ids = full.gather(1, src.clamp(max=width + resp_len - 1))
        logits = self.decoder.logits(ids, lengths + resp_len)
        at = (lengths - 1)[:, None] + torch.arange(resp_len, device=input_ids.device)[None, :]  # predicts token j
        picked = logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))
        return picked.log_softmax(-1).gather(-1, responses[..., None]).squeeze(-1)

    def _ensure_cache(self, slots: int, length: int) -> None:
        """A cache of at least ``slots`` rows and ``length`` positions. A longer one than needed is kept
        (positions past a row's context are masked), so batches with shorter prompts reuse it and the
        graphs captured over it; a larger one is allocated once, with the positions up to the model's
        limit when that costs at most twice the asked length."""
        if self.cache is not None and self.cache[0][0].shape[0] >= slots and self.cache[0][0].shape[2] >= length:
            return
        old_slots, old_len = (self.cache[0][0].shape[0], self.cache[0][0].shape[2]) if self.cache else (0, 0)
        # graphs read the old cache tensors. Their memory pool goes with them: once its last graph is freed the
        # pool's use count is 0, and a capture into it again trips the caching allocator's `use_count > 0`
        # assert (seen on an H200 when a DDP worker's small probe batch was followed by a larger rollout)
        self.graphs.clear()
        self.graph_pool = None
        self.cache = None
        length = max(length, old_len)
        if self.decoder.max_positions <= 2 * length:
            length = max(length, self.decoder.max_positions)
        self.cache = self.decoder.new_cache(max(slots, old_slots), length)

    def _target_size(self, n_alive: int, size: int, batch: int) -> int:
        """Slots to run once ``n_alive`` rows are left: the smallest captured bucket that holds them
        (CUDA graphs), or ``n_alive`` itself once a quarter of the slots are idle (eager; compacting
        copies the cache, so not at every finished row)."""
        if self.use_graphs:
            return bucket_of(n_alive, buckets_for(batch))
        return n_alive if n_alive <= size * 3 // 4 else size

    def _step(self, size: int, tokens: torch.Tensor, pos: torch.Tensor, attend: int | None = None) -> torch.Tensor:
        """One decode step over the first ``size`` slots; eager, attention over the first ``attend`` cache indices
        (default: up to the largest position)."""
        k_cache, v_cache = self.cache
        if not self.use_graphs:
            attend = None if self.compiled else (attend or int(pos.max()) + 1)
            return self.step_fn(tokens, pos, [c[:size] for c in k_cache], [c[:size] for c in v_cache], attend)
        if size not in self.graphs:
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            self.graphs[size] = _GraphedStep(self.step_fn, size, [c[:size] for c in k_cache],
                                             [c[:size] for c in v_cache], self.decoder.device, self.graph_pool)
            self.stats["graph_captures"] += 1
        return self.graphs[size](tokens, pos)

    def open_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, *,
                  budget: int, generator: torch.Generator | None = None, deterministic: bool = False) -> Trajectories:
        """Rows that generate turn by turn (:mod:`rlcore.rollout.turns`) from left-padded prompts, each continuing
        from its own KV cache slot: an observation is prefilled there, and only its tokens, while the other
        rows decode. ``budget``: response columns per row (model and observation tokens together).
        ``deterministic``: observations fed token by token in the decode steps, every step over all slots and the
        whole cache, so a row's numbers never depend on the others' (``rlcore.rollout.turns``)."""
        batch = input_ids.shape[0]
        lengths = attention_mask.long().sum(-1)
        if batch == 0 or int(lengths.min()) < 1:
            raise ValueError("static rollout engine: every prompt needs at least one token")
        max_len = int(lengths.max())
        if max_len + budget > self.decoder.max_positions:
            raise ValueError(f"static rollout engine: prompt ({max_len}) + trajectory budget ({budget}) exceed the "
                             f"model's max_position_embeddings ({self.decoder.max_positions})")
        size = bucket_of(batch, buckets_for(batch)) if self.use_graphs else batch
        with torch.inference_mode():
            # one index past the longest trajectory: slots that sit a decode step out write there
            self._ensure_cache(size, max_len + budget + 1)
            logits = self._prefill_rows(input_ids, lengths)
        rows = _StaticRows(self, lengths, size, fixed_shape=deterministic)
        return Trajectories(rows, logits, params, budget=budget, eos_token_id=self.eos_token_id,
                            pad_token_id=self.pad_token_id, generator=generator, token_by_token=deterministic)

    def _prefill_rows(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Prefill each distinct left-padded prompt once into cache slots ``0..batch-1``; each row's logits."""
        batch, width = input_ids.shape
        cols = torch.arange(int(lengths.max()), device=input_ids.device)
        src = (width - lengths)[:, None] + cols[None, :]
        right = torch.where(cols[None, :] < lengths[:, None], input_ids.gather(1, src.clamp(max=width - 1)),
                            torch.zeros((), dtype=input_ids.dtype, device=input_ids.device))
        return self._prefill(right, lengths, torch.arange(batch, device=input_ids.device))

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator | None = None, *, refresh: WeightRefresh | None = None,
                 seeds: Sequence[int] | None = None, prefixes: Sequence[CachedPrefix | None] | None = None,
                 keep_prefixes: bool = False) -> dict:
        """The engine interface's generate (:class:`~rlcore.rollout.base.RolloutEngine`). With ``refresh`` (partial
        rollouts), newer weights are taken between decode steps: :meth:`WeightRefresh.poll` loads them into the model,
        the running rows' KV cache is computed again with them (:meth:`_refill`), and ``token_versions`` ``[batch,
        max_new_tokens]`` says which version sampled each token (its ``log_probs`` are that version's). With ``seeds``,
        each row samples from uniforms of its own seed (``row_uniforms``), whatever rows it is batched with.

        ``prefixes`` (one per row, or None): a row whose prompt starts with a prefix's tokens takes that prefix's keys
        and values and computes only the rest of its prompt (:meth:`Decoder.extend`; at least its last token).
        ``keep_prefixes``: ``prefixes`` in the result, each row's keys and values at its end (its prompt and tokens
        but the last), for a later call."""
        batch, width = input_ids.shape
        device = input_ids.device
        new = params.max_new_tokens
        tokens = torch.full((batch, new), self.pad_token_id, dtype=torch.long, device=device)
        log_probs = torch.zeros((batch, new), dtype=torch.float32, device=device)
        resp_mask = torch.zeros((batch, new), dtype=torch.long, device=device)
        step_versions = None if refresh is None else [refresh.version] * new  # the version that sampled step t
        if batch == 0 or new == 0:
            return self._generated(tokens, resp_mask, log_probs, step_versions,
                                   [None] * batch if keep_prefixes else None)
        lengths = attention_mask.long().sum(-1)
        if int(lengths.min()) < 1:
            raise ValueError("static rollout engine: every prompt needs at least one token")
        max_len = int(lengths.max())
        length = max_len + new
        if length > self.decoder.max_positions:
            raise ValueError(f"static rollout engine: prompt ({max_len}) + max_new_tokens ({new}) exceed the "
                             f"model's max_position_embeddings ({self.decoder.max_positions})")
        # left-padded -> right-padded (each row's prompt starts at cache index 0)
        cols = torch.arange(max_len, device=device)
        src = (width - lengths)[:, None] + cols[None, :]
        right = torch.where(cols[None, :] < lengths[:, None], input_ids.gather(1, src.clamp(max=width - 1)),
                            torch.zeros((), dtype=input_ids.dtype, device=device))
        # (a prefix's rows are continued by extend, whose padding columns write at the cache's last index)
        self._ensure_cache(bucket_of(batch, buckets_for(batch)) if self.use_graphs else batch,
                           length + (prefixes is not None))
        k_cache, v_cache = self.cache
        reuse = self._reusable(prefixes, right, lengths)
        logits = self._prefill(right, lengths, torch.nonzero(reuse == 0).squeeze(-1))
        if bool((reuse > 0).any()):
            logits = self._continue(right, lengths, reuse, prefixes, logits)
        kept: list[CachedPrefix | None] | None = [None] * batch if keep_prefixes else None
        size = bucket_of(batch, buckets_for(batch)) if self.use_graphs else batch  # slots a decode step runs
        rows = torch.arange(batch, device=device)  # original row of each running sequence
        slots = rows.clone()  # its cache slot
        dense = size == batch  # slots == arange(size): no gather/scatter around the step
        pos = lengths.clone()  # the position (= cache index) its next token is written at
        own = None if seeds is None or params.greedy else row_uniforms(seeds, new, device)  # [batch, new]
        for t in range(new):
            scaled = logits / params.temperature
            if params.greedy:
                next_tok = logits.argmax(-1)
            else:
                u = own[:, t:t + 1] if own is not None else \
                    torch.rand((batch, 1), generator=generator, device=device, dtype=torch.float64)
                probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
                next_tok = sample_from(probs, u=u if len(rows) == batch else u[rows])
            logp = scaled.log_softmax(-1).gather(-1, next_tok[:, None]).squeeze(-1)
            tokens[rows, t] = next_tok
            log_probs[rows, t] = logp
            resp_mask[rows, t] = 1
            if step_versions is not None:
                step_versions[t] = refresh.version
            alive = next_tok != self.eos_token_id
            if kept is not None:  # rows that end here: their slots are theirs until a compaction below
                done = torch.ones_like(alive) if t == new - 1 else ~alive
                self._keep(kept, rows[done], slots[done], pos[done], right, lengths, tokens)
            if t == new - 1:
                break
            n_alive = int(alive.sum())
            if n_alive == 0:
                break
            if n_alive < len(rows):
                keep = alive.nonzero().squeeze(-1)
                rows, next_tok, pos, slots = rows[keep], next_tok[keep], pos[keep], slots[keep]
                target = self._target_size(n_alive, size, batch)
                if target < size:  # compact: running rows (their live positions) to the front of the cache
                    live = int(pos.max())
                    for kc, vc in zip(k_cache, v_cache):
                        kc[:n_alive, :, :live] = kc[slots, :, :live]
                        vc[:n_alive, :, :live] = vc[slots, :, :live]
                    slots = torch.arange(n_alive, device=device)
                    size = target
                    self.stats["compactions"] += 1
                dense = n_alive == size
            if refresh is not None and refresh.poll():  # newer weights: the running rows' cache computed again
                self._refill(rows, slots, pos, right, lengths, tokens)
            if dense:
                logits = self._step(size, next_tok, pos)
            else:  # finished or padding slots run a dummy token at position 0 of their own slot
                step_tok = torch.full((size,), self.pad_token_id, dtype=torch.long, device=device)
                step_pos = torch.zeros(size, dtype=torch.long, device=device)
                step_tok[slots] = next_tok
                step_pos[slots] = pos
                logits = self._step(size, step_tok, step_pos)[slots]
            pos = pos + 1
            self.stats["decode_steps"] += 1
            self.stats["decode_rows"] += size
        return self._generated(tokens, resp_mask, log_probs, step_versions, kept)

    @staticmethod
    def _generated(tokens: torch.Tensor, resp_mask: torch.Tensor, log_probs: torch.Tensor,
                   step_versions: list[int] | None, kept: list[CachedPrefix | None] | None) -> dict:
        """generate's result; with partial rollouts ``token_versions``: every token sampled at step t by the version
        the engine held then (the same for every row running at t; a row's columns after its end are masked)."""
        out: dict = {"responses": tokens, "response_mask": resp_mask, "log_probs": log_probs}
        if step_versions is not None:
            steps = torch.tensor(step_versions, dtype=torch.long, device=tokens.device)
            out["token_versions"] = steps[None, :].expand(tokens.shape[0], -1).clone()
        if kept is not None:
            out["prefixes"] = kept
        return out

    def _prefill(self, right: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Prefill each distinct prompt among ``rows`` (of the right-padded prompts) once, into those rows' cache
        slots; the logits after every row's prompt ``[batch, vocab]`` (the other rows' are left for
        :meth:`_continue`)."""
        batch = right.shape[0]
        logits = torch.empty((batch, self.decoder.lm_head.shape[0]), dtype=torch.float32, device=right.device)
        if len(rows) == 0:
            return logits
        every = len(rows) == batch
        sub, sub_len = (right, lengths) if every else (right[rows], lengths[rows])
        width = int(sub_len.max())
        cols = torch.arange(width, device=right.device)
        uniq, uniq_mask, row_of = distinct_rows(sub[:, :width], (cols[None, :] < sub_len[:, None]).long())
        got, keys, values = self.decoder.prefill(uniq, uniq_mask.sum(-1))
        for kc, vc, k, v in zip(*self.cache, keys, values):
            if every:
                kc[:batch, :, :width] = k[row_of]
                vc[:batch, :, :width] = v[row_of]
            else:
                kc[rows, :, :width] = k[row_of]
                vc[rows, :, :width] = v[row_of]
        if every:
            return got[row_of]
        logits[rows] = got[row_of]
        return logits

    def _reusable(self, prefixes: Sequence[CachedPrefix | None] | None, right: torch.Tensor, lengths: torch.Tensor
                  ) -> torch.Tensor:
        """``[batch]``: how many leading tokens of each row's prompt its prefix holds (0: none, or prefixes of
        other weights), at most all but the prompt's last token (whose logits the first step samples from)."""
        reuse = torch.zeros(right.shape[0], dtype=torch.long)
        if prefixes is None:
            return reuse.to(right.device)
        if len(prefixes) != right.shape[0]:
            raise ValueError(f"{len(prefixes)} prefixes for {right.shape[0]} rows")
        for i, prefix in enumerate(prefixes):
            if prefix is not None and prefix.weights == self.weights_loaded:
                n = int(lengths[i])
                reuse[i] = min(prefix.common_length(right[i, :n].tolist()), n - 1)
        return reuse.to(right.device)

    def _continue(self, right: torch.Tensor, lengths: torch.Tensor, reuse: torch.Tensor,
                  prefixes: Sequence[CachedPrefix | None], logits: torch.Tensor) -> torch.Tensor:
        """The rows with ``reuse`` > 0: their prefixes' keys and values into their slots, the rest of their prompts
        computed from there (one chunked prefill); their logits into ``logits``."""
        rows = torch.nonzero(reuse > 0).squeeze(-1)
        k_cache, v_cache = self.cache
        for i in rows.tolist():
            m, prefix = int(reuse[i]), prefixes[i]
            for kc, vc, k, v in zip(k_cache, v_cache, prefix.keys, prefix.values):
                kc[i, :, :m] = k[:, :m]
                vc[i, :, :m] = v[:, :m]
        start, rest = reuse[rows], lengths[rows] - reuse[rows]
        width = int(rest.max())
        cols = torch.arange(width, device=right.device)[None, :]
        ids = right[rows].gather(1, (start[:, None] + cols).clamp(max=right.shape[1] - 1))
        ids = torch.where(cols < rest[:, None], ids, torch.zeros((), dtype=ids.dtype, device=ids.device))
        logits[rows] = self.decoder.extend(ids, rest, start, rows, k_cache, v_cache)
        self.stats["prefix_tokens"] += int(start.sum())
        self.stats["extends"] += 1
        return logits

    def _keep(self, kept: list[CachedPrefix | None], rows: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
              right: torch.Tensor, lengths: torch.Tensor, tokens: torch.Tensor) -> None:
        """Rows that just sampled their last token (at ``pos``, never fed): their keys and values, copied out of
        their ``slots`` (one gather per layer; each row's prefix a view of its part), into ``kept`` as
        :class:`~rlcore.rollout.base.CachedPrefix`."""
        if len(rows) == 0:
            return
        width = int(pos.max())
        k_cache, v_cache = self.cache
        keys, values = [kc[slots, :, :width] for kc in k_cache], [vc[slots, :, :width] for vc in v_cache]
        prompts, sampled = right[rows].tolist(), tokens[rows].tolist()
        for j, (row, n, end) in enumerate(zip(rows.tolist(), lengths[rows].tolist(), pos.tolist())):
            kept[row] = CachedPrefix(tuple(prompts[j][:n] + sampled[j][:end - n]), tuple(k[j, :, :end] for k in keys),
                                     tuple(v[j, :, :end] for v in values), self.weights_loaded)

    def _refill(self, rows: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, right: torch.Tensor,
                lengths: torch.Tensor, tokens: torch.Tensor) -> None:
        """After a weight change: each running row's keys and values computed again with the new weights, from its
        prompt (``right``: right-padded prompts of ``lengths``, every row of the batch) and the tokens it sampled
        before its newest one (which the next decode step feeds at ``pos``), into its cache ``slots``; ``rows``: the
        running rows' indices in the batch."""
        width = int(pos.max())
        cols = torch.arange(width, device=pos.device)[None, :]
        prompt_len = lengths[rows][:, None]
        prompt = right[rows].gather(1, cols.clamp(max=right.shape[1] - 1).expand(len(rows), -1))
        sampled = tokens[rows].gather(1, (cols - prompt_len).clamp(min=0, max=tokens.shape[1] - 1))
        ids = torch.where(cols < prompt_len, prompt, sampled)
        _, keys, values = self.decoder._hidden(torch.where(cols < pos[:, None], ids, 0), pos)
        for kc, vc, k, v in zip(*self.cache, keys, values):
            kc[slots, :, :width] = k
            vc[slots, :, :width] = v
        self.stats["refills"] += 1


class _StaticRows:
    """The static engine's side of :class:`~rlcore.rollout.turns.Trajectories`: each row's KV cache slot and the
    position its next token goes to. A forward runs the rows with one token pending as one decode step over the
    first ``size`` slots (the other slots, waiting for a tool or finished, run a pad token at the cache's last
    index, which no row uses) and the rows with an observation pending as one chunked prefill of only those
    tokens (:meth:`Decoder.extend`). Once a quarter of the slots belong to finished rows (eager), or the live rows
    fit a smaller bucket (CUDA graphs), the live rows' caches move to the front slots. With ``fixed_shape`` every
    decode step runs all the slots over the whole cache and nothing moves (so the step's shapes, and each row's
    numbers, never depend on the other rows)."""

    def __init__(self, engine: StaticRolloutEngine, lengths: torch.Tensor, size: int, fixed_shape: bool = False):
        self.engine, self.size, self.fixed_shape = engine, size, fixed_shape
        self.batch = len(lengths)
        self.pos = lengths.clone()  # [batch] where each row's next token goes (its tokens in the cache)
        self.slot = torch.arange(self.batch, device=lengths.device)  # [batch] each row's cache slot
        self.live = set(range(self.batch))

    def release(self, row: int) -> None:
        self.live.discard(row)

    @torch.inference_mode()
    def forward(self, rows: list[int], pending: list[list[int]]) -> torch.Tensor:
        self._compact()
        e, device = self.engine, self.pos.device
        out = torch.empty((len(rows), e.decoder.lm_head.shape[0]), dtype=torch.float32, device=device)
        one = [i for i, p in enumerate(pending) if len(p) == 1]
        many = [i for i, p in enumerate(pending) if len(p) > 1]
        index = torch.tensor(rows, device=device)
        if one:
            every = len(one) == len(rows)  # (the usual step: each row feeds its last token)
            slots = self.slot[index if every else index[one]]
            pos = self.pos[index if every else index[one]]
            last_index = e.cache[0][0].shape[2] - 1
            tokens = torch.full((self.size,), e.pad_token_id, dtype=torch.long, device=device)
            step_pos = torch.full((self.size,), last_index, dtype=torch.long, device=device)
            tokens[slots] = torch.tensor([pending[i][0] for i in one], device=device)
            step_pos[slots] = pos
            attend = last_index + 1 if self.fixed_shape else int(pos.max()) + 1
            logits = e._step(self.size, tokens, step_pos, attend=attend)[slots]
            if every:
                out = logits
            else:
                out[one] = logits
            e.stats["decode_steps"] += 1
            e.stats["decode_rows"] += self.size
        if many:
            many_index = index[many]
            width = max(len(pending[i]) for i in many)
            ids = torch.tensor([pending[i] + [e.pad_token_id] * (width - len(pending[i])) for i in many],
                               dtype=torch.long, device=device)
            lengths = torch.tensor([len(pending[i]) for i in many], device=device)
            out[many] = e.decoder.extend(ids, lengths, self.pos[many_index], self.slot[many_index], *e.cache)
            e.stats["extends"] += 1
        self.pos[index] += torch.tensor([len(p) for p in pending], device=device)
        return out

    def _compact(self) -> None:
        """Move the live rows' caches to the front slots when the engine's rule says the batch should shrink."""
        n = len(self.live)
        target = self.engine._target_size(max(n, 1), self.size, self.batch)
        if target >= self.size or n == 0 or self.fixed_shape:
            return
        live = torch.tensor(sorted(self.live), device=self.pos.device)
        old, upto = self.slot[live], int(self.pos[live].max())
        for kc, vc in zip(*self.engine.cache):
            kc[:n, :, :upto] = kc[old, :, :upto]
            vc[:n, :, :upto] = vc[old, :, :upto]
        self.slot[live] = torch.arange(n, device=self.pos.device)
        self.size = target
        self.engine.stats["compactions"] += 1
