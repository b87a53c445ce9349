"""Loading models and tokenizers from local Hugging Face folders (never from a hub), and the
typed spec of how a worker loads and wraps the models it holds (:class:`ModelSpec`).

A folder may also be a LoRA adapter folder (``rlcore.engine.lora``): loaded for use, its adapter is merged into
its base; loaded for training with LoRA on, the adapter trains on."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from rlcore import cache
from rlcore.engine import fused, lora, packed
from rlcore.engine.lora import LoraSpec
from rlcore.engine.sequence import SequenceModel, forward_for
from rlcore.engine.strategy import make_strategy
from rlcore.engine.tiny_model import materialize_tiny
from rlcore.errors import ConfigError, InputNotFound

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Cache for the built-in model, outside the DVC-tracked folders.
TINY_CACHE = cache.root()


def resolve_model_path(path: str, *, tiny_shape: dict, seed: int) -> Path:
    """'tiny' -> the built-in model folder; otherwise a local HF folder that must exist."""
    if path == "tiny":
        return materialize_tiny(TINY_CACHE, seed=seed, **tiny_shape)
    folder = Path(path)
    if not (folder / "config.json").is_file() and not lora.is_adapter(folder):
        raise InputNotFound(f"model.path {path!r}: expected a local Hugging Face model folder with config.json (or a "
                            f"LoRA adapter folder with {lora.ADAPTER_CONFIG})")
    return folder


def load_tokenizer(path: str | Path):
    """Tokenizer from a local folder; a missing pad token falls back to EOS."""
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ConfigError(f"{path}: tokenizer has no chat_template; prompts are chat messages")
    return tok


def attention_for(path: str | Path, attn_implementation: str, packed_forward: bool) -> str:
    """The attention implementation to load with: the packed one (``rlcore.engine.packed``) when
    asked for, on top of sdpa, and the architecture allows it; otherwise the one configured."""
    if not packed_forward or attn_implementation != "sdpa":
        return attn_implementation
    config = AutoConfig.from_pretrained(str(lora.architecture_folder(path)), local_files_only=True)
    reason = packed.packing_supported(config)
    if reason:
        print(f"model.packed_forward: {path}: {reason}; running padded forwards", file=sys.stderr, flush=True)
        return attn_implementation
    return packed.register()


def load_causal_lm(path: str | Path, *, dtype: str = "float32", attn_implementation: str = "sdpa",
                   packed_forward: bool = False):
    """The causal LM at ``path``; an adapter folder's adapter merged into its base."""
    if lora.is_adapter(path):
        base = load_causal_lm(lora.adapter_base(path), dtype=dtype, attn_implementation=attn_implementation,
                              packed_forward=packed_forward)
        return lora.merged(lora.load_adapter(base, path, trainable=False))
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=DTYPES[dtype], attn_implementation=attention_for(path, attn_implementation, packed_forward),
        local_files_only=True,
    )
    fused.use_fused_ops(model)
    return model


def load_value_model(path: str | Path, *, dtype: str = "float32", attn_implementation: str = "sdpa",
                     packed_forward: bool = False):
    """A token-classification head with one output on the policy backbone (the critic).

    Loading a causal-LM folder initialises the value head fresh; loading a saved critic
    folder restores it (an adapter folder: merged into its base). The head's dropout is off (transformers
    defaults it to 0.1): values must be the same for the same input, on every call and every rank.
    """
    if lora.is_adapter(path):
        base = load_value_model(lora.adapter_base(path), dtype=dtype, attn_implementation=attn_implementation,
                                packed_forward=packed_forward)
        return lora.merged(lora.load_adapter(base, path, trainable=False))
    config = AutoConfig.from_pretrained(str(path), num_labels=1, local_files_only=True)
    config.classifier_dropout = 0.0
    model = AutoModelForTokenClassification.from_pretrained(
        str(path), config=config, dtype=DTYPES[dtype],
        attn_implementation=attention_for(path, attn_implementation, packed_forward), local_files_only=True,
    )
    fused.use_fused_ops(model)
    return model


@dataclass(frozen=True)
class ModelSpec:
    """How a worker loads and wraps its models (params.yaml ``model`` and ``resources``)."""

    path: str
    """Local Hugging Face folder."""
    dtype: str = "float32"
    """Compute dtype of forwards (weights, optimizer state and checkpoints stay float32)."""
    attn_implementation: str = "sdpa"
    packed_forward: bool = True
    """Packed forwards where the architecture allows (``rlcore.engine.packed``)."""
    strategy: str = "ddp"
    """``rlcore.engine.strategy.STRATEGIES`` name."""
    reshard_after_forward: bool = False
    """Sharding strategies: models that train free gathered weights after forward."""
    ref_reshard_after_forward: bool = False
    """Sharding strategies: the frozen reference does."""
    lora: LoraSpec = LoraSpec()
    """LoRA of the model a worker trains (rank 0: every parameter trains)."""
    gradient_checkpointing: bool = False
    """Decoder layers recompute their activations during backward."""
    offload_params: bool = False
    """Sharding strategies on a GPU: parameters, gradients and optimizer state in CPU memory between uses."""

    @property
    def base(self) -> Path:
        """The full model folder under ``path`` (the base of an adapter folder): what a saved adapter points at."""
        return lora.adapter_base(self.path) if lora.is_adapter(self.path) else Path(self.path)

    @property
    def continues_adapter(self) -> bool:
        """Training goes on with the adapter at ``path`` (LoRA on and ``path`` an adapter folder)."""
        return self.lora.on and lora.is_adapter(self.path)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return None if self.dtype == "float32" else DTYPES[self.dtype]


def wrap_for_training(spec: ModelSpec, module: torch.nn.Module, device: torch.device, *,
                      frozen: bool = False) -> SequenceModel:
    """``module`` (float32, on ``device``) wrapped with the spec's strategy: trainable, or ``frozen``
    (eval mode, no gradients: a reference model)."""
    strategy = make_strategy(spec.strategy, device, spec.compute_dtype, offload=spec.offload_params)
    if frozen:
        module = module.eval().requires_grad_(False)
    else:
        module = module.train()
        if spec.gradient_checkpointing:
            # non-reentrant: correct with frozen inputs (LoRA's frozen embeddings) and with FSDP2
            hf = lora.hf_model(module)
            if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns there
                hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reshard = spec.ref_reshard_after_forward if frozen else spec.reshard_after_forward
    module = strategy.wrap(module, reshard_after_forward=reshard)
    return SequenceModel(module, strategy, forward_for(module))


def _load_kwargs(spec: ModelSpec) -> dict:
    return {"attn_implementation": spec.attn_implementation, "packed_forward": spec.packed_forward}


def trained_causal_lm(spec: ModelSpec, *, with_reference: bool = False) -> torch.nn.Module:
    """The causal LM a worker trains (float32, on the CPU): plain; with a fresh LoRA adapter (LoRA on, ``path`` a full
    model); or with the adapter at ``path`` training on (and, ``with_reference``, a frozen copy of it)."""
    if spec.continues_adapter:
        base = load_causal_lm(spec.base, **_load_kwargs(spec))
        return lora.load_adapter(base, spec.path, trainable=True, with_reference=with_reference)
    module = load_causal_lm(spec.path, **_load_kwargs(spec))
    return lora.add_adapter(module, spec.lora, seed=spec.lora.seed) if spec.lora.on else module


def load_policy(spec: ModelSpec, device: torch.device, *, frozen: bool = False,
                with_reference: bool = False) -> SequenceModel:
    """The causal LM at ``spec.path`` wrapped for training (or frozen, for a reference; LoRA is for training)."""
    if frozen:
        module = load_causal_lm(spec.path, **_load_kwargs(spec))
    else:
        module = trained_causal_lm(spec, with_reference=with_reference)
    return wrap_for_training(spec, module.to(device), device, frozen=frozen)


def load_critic(spec: ModelSpec, device: torch.device) -> SequenceModel:
    """The value model at ``spec.path`` (a fresh value head on a causal-LM folder; an adapter folder merged into its
    base) wrapped for training, with a fresh LoRA adapter when ``spec.lora`` is on (its head trains fully). A critic
    never continues an adapter: it saves merged folders (:func:`save_pretrained` with ``merge``)."""
    module = load_value_model(spec.path, **_load_kwargs(spec))
    if spec.lora.on:
        module = lora.add_adapter(module, spec.lora, kind="value", key="critic.lora", seed=spec.lora.seed)
    return wrap_for_training(spec, module.to(device), device)


def load_rollout_model(spec: ModelSpec, device: torch.device) -> torch.nn.Module:
    """A plain (unwrapped) copy of the causal LM in the compute dtype, for a rollout engine. With LoRA on, the copy
    keeps the policy's adapter layers unmerged (those of the adapter at ``path``, or fresh ones), so a weight sync
    moves only the adapters' tensors."""
    if spec.continues_adapter:
        module = lora.load_adapter(load_causal_lm(spec.base, **_load_kwargs(spec)), spec.path, trainable=False)
    else:
        module = load_causal_lm(spec.path, **_load_kwargs(spec))
        if spec.lora.on:
            module = lora.add_adapter(module, spec.lora, seed=spec.lora.seed)
    return module.eval().requires_grad_(False).to(device=device, dtype=DTYPES[spec.dtype])


def save_pretrained(model: SequenceModel, path: str | Path, *, rank: int, tokenizer=None,
                    base: str | Path | None = None, merge: bool = False) -> None:
    """Write a Hugging Face folder (safetensors + config, and the tokenizer if given) of the float32
    weights from rank 0; a model with a LoRA adapter writes an adapter folder over ``base`` instead (only the
    trained tensors are gathered), or with ``merge`` a full folder of its weights with the adapter merged in.
    A collective: every rank calls it."""
    adapter = lora.is_peft(model.module)
    if adapter and merge:
        state = model.strategy.checkpoint_state_dict(model.module)
        if rank == 0:
            merged = lora.merged_copy(model.module, state)
            merged.save_pretrained(Path(path), safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(Path(path))
        return
    if adapter:
        state = model.strategy.trainable_state_dict(model.module, compute_dtype=False)
    else:
        state = model.strategy.checkpoint_state_dict(model.module)
    if rank != 0:
        return
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if adapter:
        if base is None:
            raise ValueError("save_pretrained: a LoRA model needs the folder of its base model")
        lora.save_adapter(model.module, state, out, base)
    else:
        model.module.save_pretrained(out, state_dict={k: v.cpu().contiguous() for k, v in state.items()},
                                     safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
