"""How much memory a stage's worker ranks will need, estimated before anything starts, and whether it fits.

Per rank of a worker group that trains (``sft``, or a PPO round's actor with its reference, rollout engine and
critic), in bytes:

* weights: every parameter in float32 (the master weights; ``model.dtype`` only sets the compute dtype), sharded
  over the ranks under fsdp;
* gradients and AdamW's two moments: 4 + 8 bytes per parameter that trains (a LoRA adapter's only), sharded
  under fsdp; the moments are on the CPU with ``resources.offload.optimizer`` on a GPU; and the temporaries of the
  multi-tensor AdamW step, about 4 bytes more per trained parameter (measured: a 494M-parameter full fine-tuning
  rank peaked 2.3 GiB above the estimate without them);
* reference: a second float32 copy when a KL term needs it, none with LoRA (the adapter disabled is the
  reference);
* rollout copy: the policy in the compute dtype, none where the engine reads the trainer's own tensors
  (``rlcore.workers.rollout.make_trainer_engine``), and the KV cache of ``rollout.micro_batch_size`` rows;
* under fsdp without ``resources.reshard_after_forward``, the gathered weights a forward keeps until backward;
* activations of one micro-batch's forward and backward: per token and layer about ``10 hidden + 3 intermediate``
  floats (the inputs autograd keeps for the attention and MLP matmuls), only each layer's input with gradient
  checkpointing (plus one layer recomputed); and the logits of the response tokens in float32, twice (the logits and
  their gradient), with the chunked log-prob's temporaries (four float chunks, ``rlcore.engine.logits``);
* the process itself: Python, torch, transformers and Ray's worker (measured: ``RUNTIME_BYTES``).

It is an estimate (allocator slack and temporary buffers come on top), meant to say "this cannot fit" before a
long start-up, not to plan to the last megabyte. ``rlcore diagnose`` and the sft and ppo stages print it when it
does not fit (:func:`warning`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from rlcore import cache
from rlcore.config import Config
from rlcore.engine.lora import architecture_folder
from rlcore.heap import long_lived

GIB = 2**30
# A worker rank's resident memory with torch, transformers, peft and Ray's worker loaded, before any model
# (measured on the 2-core machine: 0.42 GiB after the imports; 0.45 with Ray's threads).
RUNTIME_BYTES = int(0.45 * GIB)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know of a model."""

    params: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    kv_width: int
    """Key (or value) width of a layer: key-value heads x head dimension."""
    lora_params: dict[tuple[int, str], int]
    """Parameters of a LoRA adapter of rank r on target modules t, for the (r, t) asked about."""
    linear_names: frozenset[str]
    """The last name component of every linear layer but the output head (what ``lora.target_modules`` lists)."""


# a model config's JSON -> (parameters, (last name component, in, out) of each linear layer but the output head)
_META_COUNTS: dict[str, tuple[int, tuple[tuple[str, int, int], ...]]] = {}


def _meta_counts(config) -> tuple[int, tuple[tuple[str, int, int], ...]]:
    """:data:`_META_COUNTS`'s entry for ``config``: from this process's memory (a stage asks twice: its LoRA checks,
    then the estimate), else from rlcore's cache folder (a file per config and transformers and torch version),
    else counted on a meta model. Counting imports transformers' modeling code (about 1.5 CPU-s in a stage's
    process, which needs no model of its own) and builds the model; the file makes that once per model shape."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    key = config.to_json_string()
    if key in _META_COUNTS:
        return _META_COUNTS[key]
    digest = hashlib.sha256(f"{transformers.__version__} {torch.__version__}\n{key}".encode()).hexdigest()
    path = cache.root() / "model-shapes" / f"{digest[:32]}.json"
    try:
        saved = json.loads(path.read_text())
        counts = (int(saved["params"]), tuple((str(n), int(i), int(o)) for n, i, o in saved["linears"]))
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or a torn or foreign file: count again
        # (its class's modules, transformers' modeling code, are imported here in a stage's process: they stay)
        with long_lived(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        counts = (sum(p.numel() for p in model.parameters()), tuple(
            (name.rsplit(".", 1)[-1], m.in_features, m.out_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"params": counts[0], "linears": counts[1]}))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache folder: counted again next time
    _META_COUNTS[key] = counts
    return counts


def model_shape(folder, loras: list[tuple[int, str | tuple[str, ...]]] = ()) -> ModelShape:
    """The shape of the model in ``folder`` (an adapter folder's base; or a Hugging Face config), counted on the meta
    device (no memory)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(folder, PretrainedConfig):
        config = folder
    else:
        config = AutoConfig.from_pretrained(str(architecture_folder(folder)), local_files_only=True)
    params, linears = _meta_counts(config)
    counts = {}
    for rank, targets in loras:
        counts[(rank, targets if isinstance(targets, str) else ",".join(targets))] = sum(
            rank * (n_in + n_out) for short, n_in, n_out in linears if targets == "all-linear" or short in targets)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    return ModelShape(params=params, hidden=config.hidden_size, intermediate=config.intermediate_size,
                      layers=config.num_hidden_layers, vocab=config.vocab_size, kv_width=kv, lora_params=counts,
                      linear_names=frozenset(short for short, _, _ in linears))


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank by what holds them, and the ranks (and generators) that share a machine."""

    what: str
    """Whose memory: ``sft``, ``ppo round r1``."""
    parts: dict[str, float]
    ranks: int

    @property
    def per_rank(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        shown = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.parts.items() if v >= 0.005 * GIB)
        return f"{self.what}: about {self.per_rank / GIB:.1f} GiB per rank ({shown} GiB)"


def _activations(shape: ModelShape, tokens: int, response_tokens: int, checkpointing: bool) -> float:
    per_layer_token = 10 * shape.hidden + 3 * shape.intermediate
    if checkpointing:
        kept = tokens * (shape.hidden * shape.layers + per_layer_token)
    else:
        kept = tokens * per_layer_token * shape.layers
    return 4.0 * kept + logits_bytes(response_tokens * shape.vocab)


def logits_bytes(logits: int) -> float:
    """Bytes an update holds for ``logits`` float32 logits elements: the logits and their gradient, and the chunked
    log-prob's float temporaries (four chunks at most, ``rlcore.engine.logits``)."""
    from rlcore.engine.logits import CHUNK_ELEMENTS

    return 4.0 * (2 * logits + 4 * min(logits, CHUNK_ELEMENTS))


def trainer_estimate(cfg: Config, shape: ModelShape, role: str, what: str, *, with_ref: bool = False,
                     rollout_copy: bool = False) -> Estimate:
    """The memory of one rank of the group that trains the ``role`` (``sft``, ``actor``, ``critic``) model."""
    section, r = getattr(cfg, role), cfg.resources
    lora = section.lora
    key = (lora.rank, lora.target_modules if isinstance(lora.target_modules, str) else ",".join(lora.target_modules))
    trained = shape.lora_params.get(key, 0) if lora.rank else shape.params
    shard = r.n_workers if r.strategy in ("fsdp",) else 1
    gpu_offload = r.use_gpu and r.offload.optimizer
    micro = section.micro_batch_size
    prompt, response = cfg.task.max_prompt_length, cfg.task.max_response_length
    parts = {"weights": 4.0 * shape.params / shard, "gradients": 4.0 * trained / shard,
             "AdamW": 0.0 if gpu_offload else 8.0 * trained / shard, "AdamW step": 4.0 * trained / shard}
    if with_ref and not lora.rank:
        parts["reference"] = 4.0 * shape.params / (shard if r.ref_reshard_after_forward else 1)
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    if shard > 1 and not r.reshard_after_forward:
        parts["gathered weights"] = float(dtype_bytes * shape.params)
    if rollout_copy:
        parts["rollout copy"] = float(dtype_bytes * shape.params)
    if role == "actor":
        parts["KV cache"] = float(2 * dtype_bytes * shape.layers * shape.kv_width * cfg.rollout.micro_batch_size
                                  * (prompt + response))
    parts["activations"] = _activations(shape, micro * (prompt + response), micro * response,
                                        section.gradient_checkpointing)
    parts["runtime"] = float(RUNTIME_BYTES)
    return Estimate(what, parts, r.n_workers)


def estimates(cfg: Config, model_dir, stage: str) -> list[Estimate]:
    """The groups a stage starts (``sft``, or ``ppo`` with its actor and, for a critic estimator, the critic), for the
    model in ``model_dir`` (or of a Hugging Face config)."""
    from rlcore.algos.advantage import ESTIMATORS

    roles = ["sft"] if stage == "sft" else ["actor"] + (
        ["critic"] if ESTIMATORS.get(cfg.algorithm.adv_estimator).needs_critic else [])
    loras = [(getattr(cfg, role).lora.rank, getattr(cfg, role).lora.target_modules) for role in roles]
    shape = model_shape(model_dir, loras)
    out = []
    for role in roles:
        if role != "actor":  # (a stage reads only the params sections it declares: sft has no rollout or actor)
            out.append(trainer_estimate(cfg, shape, role, f"{stage} {role}" if stage == "ppo" else stage))
            continue
        shares = (cfg.resources.strategy == "ddp" and cfg.model.dtype == "float32" and cfg.rollout.engine == "static")
        out.append(trainer_estimate(cfg, shape, role, f"{stage} {role}",
                                    with_ref=cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward,
                                    rollout_copy=not shares))
    return out


def machine_bytes() -> tuple[float, float]:
    """(total, available) memory of this machine (``/proc/meminfo``; available = total where it cannot be read)."""
    total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return total, float(line.split()[1]) * 1024
    except OSError:
        pass
    return total, total


def gpu_bytes() -> float | None:
    """Memory of the first visible GPU, None without one."""
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


def warning(cfg: Config, model_dir, stage: str) -> str | None:
    """One line when the stage's estimate does not fit (every rank on this machine, or each on its GPU), naming the
    estimate and what would shrink it; None when it fits."""
    groups = estimates(cfg, model_dir, stage)
    if cfg.resources.use_gpu:
        budget, where = gpu_bytes(), "its GPU"
        need = sum(e.per_rank - e.parts["runtime"] for e in groups)
        if budget is None:
            return None
        fits = need <= budget
        need_text = f"{need / GIB:.1f} GiB per GPU"
    else:
        total, available = machine_bytes()
        budget, where = available, f"this machine ({available / GIB:.1f} GiB available of {total / GIB:.1f})"
        need = sum(e.per_rank for e in groups) * cfg.resources.n_workers
        fits = need <= budget
        need_text = f"{need / GIB:.1f} GiB for {cfg.resources.n_workers} ranks"
    if fits:
        return None
    tips = "set actor/critic/sft.lora.rank (e.g. 16), .gradient_checkpointing: true, a smaller .micro_batch_size"
    return (f"memory: {need_text} will not fit {where}; " + "; ".join(e.describe() for e in groups) +
            f". To shrink it: {tips}")
