"""Typed schema of params.yaml.

Every knob of every stage lives here, with its default and a docstring. Loading is
strict: an unknown key, a wrong type, an out-of-range value or an unknown registry
name stops the stage before Ray starts, with one line naming the key, the bad value
and what is allowed::

    cfg = load_config("params.yaml")
    cfg.algorithm.adv_estimator  # "grpo"
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, Strict, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from rlcore import names
from rlcore.errors import ConfigError

__all__ = ["Config", "ConfigError", "load_config", "parse_config"]


class _Section(BaseModel):
    # serialize_by_alias: a key that is a Python keyword (ppo.async) is a field with an alias. strict: a value of
    # another type is refused, not converted (`train_batch_size: "32"`, quoted, is text; `enabled: 1` is not a bool);
    # an int is still a float, and a list field of tuples says so (strict=False): YAML has lists, not tuples.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, serialize_by_alias=True,
                              strict=True)


KEEPS_STEPS = {"keeps_steps": True}
"""``Field(..., json_schema_extra=KEEPS_STEPS)``: the key (or the whole section) cannot change the steps a stage has
done: how often it checkpoints, when a divergence stops it, where it logs, which Ray it joins. A step checkpoint
taken under another value of it resumes (:func:`step_params`)."""


class RayConfig(_Section):
    address: str = "local"
    """'local' starts a private Ray instance on this machine; 'auto' or 'ray://host:10001' joins a cluster."""
    num_cpus: int = Field(2, ge=1)
    """Logical CPUs given to a local Ray instance (ignored when joining a cluster)."""
    timeout_s: float = Field(600.0, gt=0)
    """Seconds to wait for a placement group or a worker call before failing."""


class TrackingConfig(_Section):
    uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI; a relative sqlite path is resolved against the repository root."""
    experiment: str = "rlcore"
    """MLflow experiment that every stage logs into."""
    enabled: bool = True
    """False logs nothing (a null tracker)."""


class TinyModelConfig(_Section):
    arch: Literal["llama", "qwen2"] = "llama"
    """Hugging Face architecture of the built-in model."""
    hidden_size: int = Field(64, ge=8)
    """Width of the residual stream."""
    num_layers: int = Field(3, ge=1)
    """Decoder layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads (hidden_size must be divisible by it)."""
    intermediate_size: int = Field(256, ge=8)
    """MLP width."""
    max_position_embeddings: int = Field(128, ge=16)
    """Longest sequence the model accepts."""

    @model_validator(mode="after")
    def _heads_divide(self) -> "TinyModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.tiny.hidden_size {self.hidden_size} is not divisible by model.tiny.num_heads {self.num_heads}")
        return self


class ModelConfig(_Section):
    path: str = "tiny"
    """'tiny' builds the built-in character-level model; otherwise a local Hugging Face model folder."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the built-in model (used only when path is 'tiny')."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype for training (float32 on CPU)."""
    attn_implementation: Literal["eager", "sdpa"] = "sdpa"
    """Attention kernel passed to transformers."""
    packed_forward: bool = True
    """Log-prob, value and prefill forwards run each distinct prompt and each distinct (prompt ; response)
    row once and skip padding tokens (rlcore.engine.packed; same results up to float rounding). Needs
    attn_implementation sdpa and a llama/qwen2/qwen3 model; other models run padded forwards."""


class FileColumns(_Section):
    prompt: str = Field("prompt", min_length=1)
    """Column of the prompt: text (one user message) or a list of chat messages {role, content}. A dotted name
    reaches into a nested column (reward_model.ground_truth)."""
    ground_truth: str = Field("ground_truth", min_length=1)
    """Column of what the reward compares against: text, or a number (written as text)."""
    demonstration: str = Field("demonstration", min_length=1)
    """Column of the SFT target: text, or chat messages ending with the assistant's. Required in the SFT rows."""
    data_source: str | None = None
    """Column naming each row's data_source; null: every row gets task.data_source."""


class PairsConfig(_Section):
    n_train: int = Field(0, ge=0)
    """Pairs in data/processed/pairs_train.parquet (0: none written)."""
    n_test: int = Field(0, ge=0)
    """Pairs in data/processed/pairs_test.parquet, one from each of the test split's first n_test questions (so at
    most task.n_test of them)."""
    flip_rate: float = Field(0.0, ge=0.0, le=1.0)
    """Share of training pairs whose chosen and rejected answers are swapped (label noise; the test pairs never are)."""


class TaskConfig(_Section):
    name: str = "arithmetic"
    """Task builder from rlcore.data (arithmetic: synthetic; calculator: multiplication with a calculator tool, for
    rollout.agent.loop tool; gsm8k: local GSM8K-format files; file: your own .jsonl/.parquet files, task.file and
    task.columns)."""
    min_digits: int = Field(1, ge=1)
    """Fewest digits of an arithmetic operand."""
    max_digits: int = Field(2, ge=1)
    """Most digits of an arithmetic operand."""
    ops: tuple[Literal["+", "-", "*"], ...] = Field(("+",), strict=False)
    """Arithmetic operators to draw from."""
    n_sft: int = Field(2000, ge=1)
    """Problems in the SFT split."""
    n_rl: int = Field(4000, ge=1)
    """Prompts in the RL split."""
    n_test: int = Field(256, ge=1)
    """Held-out test problems."""
    sft_carry_error_rate: float = Field(0.6, ge=0.0, le=1.0)
    """Imperfect demonstrator (arithmetic): share of carrying SFT problems whose demonstration is the
    carry-free sum (58+67 -> 15). Rewards and the test split always use the true answer, so RL with the
    verifiable reward has to fix what imitation learned; 0 = clean demonstrations."""
    long_tail_frac: float = Field(0.0, ge=0.0, le=1.0)
    """Long-tailed responses (arithmetic): share of problems (every split) that ask for a long answer: the question
    ends with "=" and the demonstration is long_tail_length "." before the number (rewards accept the filler)."""
    long_tail_length: int = Field(24, ge=1)
    """Filler characters of a long answer before the number (needs max_response_length >= it + answer digits + 1)."""
    sft_tool_rate: float = Field(0.5, ge=0.0, le=1.0)
    """calculator: share of SFT problems whose demonstration calls the calculator tool (the rest answer at once)."""
    sft_tool_error_rate: float = Field(0.0, ge=0.0, le=1.0)
    """calculator: share of the demonstrations' calculator calls that type + for * (and answer with that result)."""
    file: dict[Literal["train", "test", "sft"], str] = {}
    """Local .jsonl/.parquet files of tasks gsm8k and file: train (RL prompts; also the SFT rows when sft is
    absent), test (held-out prompts), sft (optional: prompts with demonstrations). Each is a DVC dependency of the
    prepare stage (dvc.yaml's task_file stages); leave a key out rather than setting it to null."""
    columns: FileColumns = FileColumns()
    """task file: where each field of a row is in the files (rlcore.data.files)."""
    data_source: str = Field("file", min_length=1)
    """task file: the data_source of every row when columns.data_source is null (it selects the built-in rule
    reward, if there is one of that name: arithmetic, gsm8k, math; your reward.functions receive it)."""
    pairs: PairsConfig = PairsConfig()
    """arithmetic: built-in preference pairs for a reward model, written by prepare (data/processed/pairs_*.parquet)."""
    max_prompt_length: int = Field(16, ge=1)
    """Prompt tokens after the chat template; longer prompts are an error."""
    max_response_length: int = Field(6, ge=1)
    """Generated tokens per response (SFT targets longer than this are an error)."""

    @field_validator("name")
    @classmethod
    def _known_task(cls, v: str) -> str:
        return names.check_name("task", v, names.TASKS)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in (("gsm8k_train_path", "file.train"), ("gsm8k_test_path", "file.test")):
                if old in data:
                    raise ValueError(f"task.{old} is now task.{new} (a DVC dependency of the prepare stage)")
        return data

    @model_validator(mode="after")
    def _digit_range(self) -> "TaskConfig":
        if self.min_digits > self.max_digits:
            raise ValueError(f"task.min_digits {self.min_digits} exceeds task.max_digits {self.max_digits}")
        if (self.pairs.n_train or self.pairs.n_test) and self.name != "arithmetic":
            raise ValueError(f"task.pairs (built-in preference pairs) exist for task arithmetic only, not {self.name}: "
                             "give rm.models your own pairs files")
        if self.name in ("gsm8k", "file"):
            for key in ("train", "test"):
                if key not in self.file:
                    raise ValueError(f"task.name {self.name} needs task.file.{key} (a local .jsonl or .parquet file)")
        if self.name == "arithmetic" and self.long_tail_frac > 0:
            # largest answer: max_digits + 1 digits for "+", 2 * max_digits for "*", max_digits for "-"
            high = 10**self.max_digits - 1
            largest = {"+": high + high, "*": high * high, "-": high}
            digits = max((len(str(largest[op])) for op in self.ops), default=1)
            need = self.long_tail_length + digits + 1
            if self.max_response_length < need:
                raise ValueError(f"task.long_tail_frac {self.long_tail_frac} needs task.max_response_length >= {need} "
                                 f"(task.long_tail_length {self.long_tail_length} + {digits} answer digits + 1 EOS), "
                                 f"got {self.max_response_length}")
        return self


class LoraSettings(_Section):
    rank: int = Field(0, ge=0)
    """LoRA rank (peft adapters on the target modules; the base weights stay frozen). 0 = off: every parameter
    trains. With it on, the reference log-probs come from the same model with the adapter disabled (no second
    copy), step checkpoints hold the adapters only, and the saved model folder is an adapter folder over the
    base (rlcore export merges it into a plain Hugging Face folder)."""
    alpha: float = Field(32.0, gt=0)
    """The adapter's update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input during updates (log-prob forwards and the rollout run without it)."""
    target_modules: str | Annotated[tuple[str, ...], Strict(False)] = "all-linear"
    """Modules that get adapters: 'all-linear' (every linear layer but the output head) or a list of module
    names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj for Llama/Qwen2)."""

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v: str | tuple[str, ...]) -> str | tuple[str, ...]:
        if isinstance(v, str) and v != "all-linear":
            raise ValueError("expected 'all-linear' or a list of module names")
        if not isinstance(v, str) and (not v or not all(name.strip() for name in v)):
            raise ValueError("expected 'all-linear' or a non-empty list of module names")
        return v


class OffloadSettings(_Section):
    params: bool = False
    """GPU runs with resources.strategy fsdp: keep parameters, gradients and the optimizer state in CPU memory
    between uses (FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU). Slower; fits larger models."""
    optimizer: bool = False
    """GPU runs: move the AdamW state to CPU memory after each optimizer step and back before the next, so
    generation and log-prob forwards have that memory (verl's optimizer offload)."""


class ResourcesConfig(_Section):
    n_workers: int = Field(2, ge=1)
    """Ranks of each worker group (the data-parallel world size)."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """Logical CPUs per rank; also its torch thread count (rounded, at least 1)."""
    cpu_kernels: Literal["portable", "native"] = "portable"
    """CPU kernels of every process rlcore starts (rlcore.kernels): portable = PyTorch's and oneDNN's AVX2 code paths
    and MKL's vendor-neutral reproducible branch, so the same params and seed give the same bits on any x86-64 CPU
    with AVX2, Intel or AMD (MKL's matrix products run slower); native = each library's fastest choice for this CPU,
    whose results differ between CPU models."""
    use_gpu: bool = False
    """One GPU per rank and the nccl backend (needs CUDA)."""
    placement: Literal["pack", "spread"] = "pack"
    """Where Ray puts the ranks (one placement group bundle each) on a cluster. pack: as few nodes as fit them
    (Ray's PACK; collectives stay on one node). spread: each rank on a different node while there are nodes
    to spread over, then sharing (Ray's SPREAD, best effort; never refuses to start). A stage prints the
    node of every rank. On a private local Ray (one node) both are the same."""
    strategy: str = "ddp"
    """How a worker group's ranks hold the models (rlcore.engine.distributed). ddp: every rank keeps the whole
    model and optimizer state, gradients are averaged in one all-reduce per optimizer step, the rollout copy
    is refreshed without communication: the faster choice for a model that fits on one rank (the default
    tiny model, small HF models). fsdp: FSDP2 shards parameters, gradients and optimizer state over the
    ranks (the two reshard switches below apply): for models that do not fit on one rank."""
    reshard_after_forward: bool = False
    """FSDP2 for the models that train (actor, critic). True frees each block's gathered weights after
    its forward and gathers them again for backward (ZeRO-3: a rank holds its shard plus one block).
    False keeps them from forward to backward (ZeRO-2: one all-gather fewer per micro-batch, but a
    full copy of the weights on every rank meanwhile); faster while the model fits on a rank."""
    ref_reshard_after_forward: bool = False
    """The same for the frozen reference model, which has no backward to free them. False gathers it on
    its first forward and keeps a full copy on every rank from then on (no more all-gathers); True
    re-gathers it block by block in every forward and holds only a shard."""
    offload: OffloadSettings = OffloadSettings()
    """GPU memory moved to the CPU (GPU runs only; a CPU run refuses it)."""

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, v: str) -> str:
        return names.check_name("training strategy", v, names.STRATEGIES)

    @model_validator(mode="after")
    def _reshard_needs_sharding(self) -> "ResourcesConfig":
        for key in ("reshard_after_forward", "ref_reshard_after_forward"):
            if getattr(self, key) and self.strategy not in names.SHARDED_STRATEGIES:
                sharding = ", ".join(map(repr, names.SHARDED_STRATEGIES))
                raise ValueError(f"resources.{key} is true but resources.strategy is {self.strategy!r}; "
                                 f"it only applies to a sharding strategy ({sharding})")
        for key in ("params", "optimizer"):
            if getattr(self.offload, key) and not self.use_gpu:
                raise ValueError(f"resources.offload.{key} is true but resources.use_gpu is false: offload moves GPU "
                                 "memory to the CPU, and a CPU run has none to move (set it to false)")
        if self.offload.params and self.strategy not in names.SHARDED_STRATEGIES:
            raise ValueError(f"resources.offload.params is true but resources.strategy is {self.strategy!r}; it is "
                             f"FSDP2's CPU offload: set resources.strategy: fsdp")
        return self


class OptimizerSettings(_Section):
    """AdamW and its guards, the keys of every section that trains a model (sft, rm, actor, critic): the same
    meaning and limits in each, the defaults (and a doc where a section's value needs a reason) its own, given as
    ``class XConfig(OptimizerSettings, defaults={"lr": 2e-3, "weight_decay": (0.1, "why")})`` (``(..., "why")``:
    the shared default with a doc of the section's own). Its keys come first in the section."""

    lr: float = Field(1e-4, gt=0)
    """Peak AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global gradient norm."""
    max_nonfinite_steps: int = Field(3, ge=0, json_schema_extra=KEEPS_STEPS)
    """Consecutive optimizer steps skipped for a NaN or infinite loss or gradient norm after which the stage
    stops (exit code 3; the message names the step and the last finite metrics). A skipped step changes nothing
    (weights, optimizer state, learning-rate schedule) and is counted in ``<section>/nonfinite_steps``.
    0 = never stop."""

    def __init_subclass__(cls, defaults: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = set(defaults or {}) - set(OptimizerSettings.__annotations__)
        if unknown:
            raise TypeError(f"{cls.__name__}: defaults for keys OptimizerSettings does not have: {sorted(unknown)}")
        cls._optimizer_defaults = dict(defaults or {})

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """The section's own defaults and docs on copies of the shared fields (their limits kept), then the
        validator rebuilt with them."""
        super().__pydantic_init_subclass__(**kwargs)
        for key, value in cls._optimizer_defaults.items():
            default, doc = value if isinstance(value, tuple) else (value, None)
            field = copy.copy(cls.__pydantic_fields__[key])
            if default is not ...:
                field.default = default
            if doc is not None:
                field.description = doc
            cls.__pydantic_fields__[key] = field
        cls.model_rebuild(force=True)


class SFTConfig(OptimizerSettings, defaults={
        "lr": 2e-3,
        "weight_decay": (0.1, "AdamW weight decay. 0.1 makes the tiny model's SFT converge on every seed (0.0: "
                              "stuck in a plateau on some).")}):
    steps: int = Field(2000, ge=1)
    """Optimizer steps. The tiny model's loss drops suddenly, at a step that depends on the seed (1300 on seed
    11)."""
    batch_size: int = Field(64, ge=1)
    """Sequences per step across all ranks (divisible by resources.n_workers)."""
    micro_batch_size: int = Field(64, ge=1)
    """Sequences per forward/backward on one rank (gradient accumulation above it)."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up steps before cosine decay to 10% of lr."""
    save_every: int = Field(200, ge=0, json_schema_extra=KEEPS_STEPS)
    """Step checkpoint every N steps (rlcore.trainer.loop.checkpoint); a re-run after a crash resumes from the last
    one. 0 = off."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations during backward instead of keeping them from the forward:
    the same gradients, less activation memory, about one more forward of compute per update."""
    lora: LoraSettings = LoraSettings()
    """LoRA adapters (rank 0 = off: full fine-tuning)."""


class CheckpointConfig(_Section):
    dir: str = "checkpoints"
    """Folder of the step checkpoints, one subfolder per stage (relative to the repository; outside DVC's outputs,
    ignored by git and DVC). On a Ray cluster every node must reach it (a shared filesystem)."""
    keep_last: int = Field(0, ge=0)
    """Checkpoints kept when a stage succeeds (0 = all removed); while it runs, the newest max(keep_last, 1)."""


class ToolConfig(_Section):
    path: str = Field(min_length=1)
    """Python file (relative to the repository) of the tool; a DVC dependency of the stages that generate (score, the
    PPO rounds, evaluate): dvc.yaml's tool_file stages record it by sha256."""
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """A function in that file (a tool: the model calls it by this name; its schema comes from its type hints and
    docstring), or a class with reset(row), step(action) and reward() (an environment, the only entry then)."""


class AgentFileConfig(_Section):
    path: str = Field(min_length=1)
    """Python file (relative to the repository) of the agent, in a folder of its own: the file and its folder are DVC
    dependencies of the stages that run the agent (score, the PPO rounds, evaluate), recorded by sha256 in
    inputs/reward by dvc.yaml's agent_file stage."""
    name: str = Field("run", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The agent function in that file: async def run(client: openai.AsyncOpenAI, row: dict) returning the reward
    (a number, {"score": ..., **extras} or None: the reward functions score the last completion)."""

    @field_validator("path")
    @classmethod
    def _own_folder(cls, v: str) -> str:
        if Path(v).parent in (Path("."), Path("")):
            raise ValueError(f"{v!r}: put the agent file in a folder of its own (its folder is a DVC dependency of the "
                             "stages that run it: the repository's root would be all of the repository)")
        return v


class AgentConfig(_Section):
    loop: str = "single_turn"
    """How a sample is generated: single_turn (one response), tool (model turn, tool calls, observation, next turn,
    up to max_turns; rlcore.agents.loop; docs/how-to/tools.md) or openai (your agent program, written against the
    OpenAI API, talks to the policy behind an OpenAI-compatible endpoint; every completion it gets is recorded and
    trained; rlcore.agents.openai_loop; docs/how-to/openai-agents.md)."""
    tools: list[ToolConfig] = []
    """Loop tool: [{path, name}] tool functions, or one environment class."""
    agents: list[AgentFileConfig] = []
    """Loop openai: [{path, name}], one entry: the agent (a list so that dvc.yaml's agent_file stage can depend on its
    file and folder, and exist only when there is one)."""
    agent_timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False)
    """Loop openai: seconds one agent run (a whole trajectory, its waits for the model included) may take; past them
    it is cancelled, or its process killed if it does not yield, and the trajectory is a failure (timeout)."""
    on_failure: Literal["reward", "drop"] = "reward"
    """Loop openai: what a failed trajectory (the agent raised, timed out, died, sent a bad request, ran out of budget,
    never called the model or returned something that is not a reward; agent/failures/<kind>) gives: reward = its
    completions are trained with failure_reward; drop = they are not trained at all (and stay out of the group's
    baseline)."""
    failure_reward: float = Field(0.0, allow_inf_nan=False)
    """Loop openai, on_failure reward: the reward of a failed trajectory."""
    parser: str = "hermes"
    """How tool calls are read from a model turn (rlcore.agents.parsers): hermes = <tool_call>{"name": ...,
    "arguments": {...}}</tool_call>."""
    max_turns: int = Field(4, ge=1)
    """Model turns per trajectory; a trajectory whose last allowed turn still calls a tool stops, truncated. The
    token budget of a whole trajectory (model and observation tokens) is task.max_response_length. Loop openai: the
    most requests an agent may send the model per trajectory (one more is refused, and the trajectory fails)."""
    min_answer_tokens: int = Field(8, ge=1)
    """Tokens of the trajectory's budget an observation leaves for the model's next turn: an observation that would
    leave fewer is cut to fit (each tool message's text to its longest prefix that does, marked "..."; counted in
    agent/observations_cut), so the model reads what its tools said, errors included, and can still answer. A
    trajectory ends at an observation only when not even the chat template's part of it fits (agent/truncated_budget).
    """
    max_tool_response_chars: int = Field(1024, ge=1)
    """A tool's output longer than this is cut to it with a note, and counted as an error (agent/tool_errors)."""
    timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    """Seconds one tool call (or environment step) may run; past them its process is killed and the call is an error
    observation."""
    memory_mb: int = Field(1024, ge=0)
    """Address-space limit of each tool process (loop openai: agent process) in MiB (resource.setrlimit RLIMIT_AS;
    0 = none)."""
    kv_cache_mb: int = Field(1024, ge=0)
    """Loop openai, static engine: MiB of keys and values (per generating worker, on the engine's device) kept
    between a trajectory's requests, so that its next request computes only the tokens the agent added to the
    history; 0 = none kept (every request computes its whole history: slower, the same log-probs up to float
    rounding). When it is full a completion's keys and values are not kept and the trajectory's next request
    computes its whole history (counted in agent/kv_not_kept: raise it, or lower the agents per worker)."""
    processes: int = Field(2, ge=1)
    """Tool processes per generating worker (calls of different rows run in parallel); loop openai: agent processes
    per generating worker, each running its share of the trajectories concurrently (asyncio)."""
    deterministic: bool = False
    """true: each trajectory's numbers are independent of when the other rows' tools answer (observations fed one
    token per decode step, every step over all rows and the whole KV cache; static engine), so a run repeats
    exactly. false: observations prefilled in one chunk and finished rows dropped from the steps: faster, and runs
    agree up to float rounding (docs/how-to/tools.md)."""

    @field_validator("loop")
    @classmethod
    def _known_loop(cls, v: str) -> str:
        return names.check_name("agent loop", v, names.AGENT_LOOPS)

    @field_validator("parser")
    @classmethod
    def _known_parser(cls, v: str) -> str:
        return names.check_name("tool-call parser", v, names.TOOL_PARSERS)

    @model_validator(mode="after")
    def _tools(self) -> "AgentConfig":
        labels = [t.name for t in self.tools]
        for i, name in enumerate(labels):
            if name in labels[:i]:
                raise ValueError(f"rollout.agent.tools[{i}].name {name!r} appears twice; the model calls tools by name")
        if self.loop == "tool" and not self.tools:
            raise ValueError("rollout.agent.loop tool needs rollout.agent.tools: [{path, name}, ...]")
        if self.loop == "openai" and len(self.agents) != 1:
            raise ValueError(f"rollout.agent.loop openai needs one agent in rollout.agent.agents: [{{path, name}}] "
                             f"(got {len(self.agents)})")
        return self


class RolloutConfig(_Section):
    engine: str = "static"
    """Generation engine from rlcore.rollout. static: preallocated KV cache, finished rows dropped from the
    batch, CUDA graphs on a GPU (Llama/Qwen2 layouts; others fall back to hf). hf: the transformers model
    in a token loop with a dynamic KV cache (any causal LM). vllm: vLLM's engine in the worker's process, weights
    moved in memory (an optional install: make setup-vllm; docs/concepts/engines.md says which to use when)."""
    compile: bool = False
    """static: torch.compile the decode step. Off by default: on a CPU the first call compiles for ~20 s per
    process and batch size and saves ~15% of a tiny model's decode step afterwards. vllm: vLLM's compiled path
    instead of its eager mode."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """vllm: KV cache space of each engine in GiB (vLLM's kv_cache_memory_bytes; the static and hf engines size
    their caches by the batch). Sequences that do not fit at once wait for others to finish."""
    cuda_graphs: bool = True
    """static, on a GPU: capture each decode step in a CUDA graph (weights are updated in place, so a
    training step never triggers a recapture)."""
    n: int = Field(8, ge=1)
    """Responses sampled per prompt in PPO rounds (the GRPO/RLOO group size)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (also applied to log-probs, as in verl)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off)."""
    micro_batch_size: int = Field(512, ge=1)
    """Sequences generated at once on one rank."""
    n_workers: int = Field(1, ge=1)
    """ppo.mode async: generator workers, each a Ray actor on its own resource bundle with a rollout engine and
    its own copy of the policy (sync mode generates on the trainer's ranks and ignores it)."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """ppo.mode async: logical CPUs of each generator's bundle; also its torch thread count (at least 1)."""
    agent: AgentConfig = AgentConfig()
    """Multi-turn agents: the loop (tool calls by rlcore, or your own agent program), the tools or the agent, the
    limits (rlcore.agents)."""

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        return names.check_name("rollout engine", v, names.ROLLOUT_ENGINES)


class RewardFunctionConfig(_Section):
    path: str = Field(min_length=1)
    """Python file of the function (relative to the repository); a DVC dependency of exactly the stages that score
    (score, the PPO rounds, evaluate): dvc.yaml's reward_file stages record it by sha256."""
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The function in that file, called as fn(data_source, solution_str, ground_truth, extra_info, **kwargs) and
    returning a float, None (does not apply to this row) or a dict with 'score' and extra values to log. Also the
    function's metrics name (reward/<name>/mean): names are unique."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of the function's score in the training reward (the weighted sum of every reward function, the
    built-in rule and the reward model)."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments every call gets (verl's reward_kwargs)."""
    batched: bool = False
    """True: called once per batch with lists (data_sources, solution_strs, ground_truths, extra_infos) and returns
    a list of scores."""


class RewardModelConfig(_Section):
    path: str = Field(min_length=1)
    """A local Hugging Face sequence-classification folder (num_labels=1): an rm stage's models/rm/<name>, or any
    other. It scores each response at its last token."""
    weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of its score in the training reward."""
    normalize: bool = True
    """Standardise scores with the mean and std the rm stage saved in the folder (reward_stats.json)."""
    micro_batch_size: int = Field(256, ge=1)
    """Sequences per reward-model forward on one rank."""
    placement: Literal["colocate", "separate"] = "colocate"
    """colocate: one rank on each bundle of the stage's resource pool, sharing it with the actor (or rollout) ranks.
    separate: one rank on a bundle of its own (cpus, and a GPU with resources.use_gpu)."""
    cpus: float = Field(1.0, gt=0)
    """placement separate: logical CPUs of the reward model's bundle (also its torch threads)."""


class RewardConfig(_Section):
    timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    """Seconds one sample's reward function may run (one call of a batched function). Past them it is stopped (its
    scoring process is killed and replaced, so a hung function ends too) and the sample scores error_score for that
    function; steps log the count as reward/timeouts and reward/<name>/timeouts. Functions run in child processes of
    the stage (rlcore.rewards.guard)."""
    error_score: float = Field(0.0, allow_inf_nan=False)
    """Score, in place of a function's, of a sample whose function raised, returned something other than a finite
    number, None or a dict with 'score', ran past timeout_s, or killed its process (reward/errors,
    reward/<name>/errors). A batch where every function failed on every sample stops the stage."""
    rule_weight: float = Field(1.0, allow_inf_nan=False)
    """Weight of the built-in rule of each row's data_source (arithmetic, gsm8k, math) in the training reward; 0 keeps
    it for evaluation only. Rows whose data_source has no rule are scored by the other functions."""
    functions: list[RewardFunctionConfig] = []
    """Your reward functions: [{path, name, weight, kwargs, batched}] (rlcore.rewards.functions)."""
    model: RewardModelConfig | None = None
    """A reward model in the training reward: {path, weight, normalize} (null: none)."""
    accuracy: str = "auto"
    """What counts as a correct answer in rollout/acc, val/*, score's filter and evaluate's pass@k: auto (the rule of
    the row's data_source where it has one, else the first of your functions that applies), rule, or the name of one
    of your functions. A sample is correct when that score is >= 1."""
    processes: int = Field(2, ge=1)
    """Scoring processes: a batch is split over them, so slow functions run in parallel."""

    @model_validator(mode="after")
    def _names(self) -> "RewardConfig":
        labels = [f.name for f in self.functions]
        for i, name in enumerate(labels):
            if name in ("rule", "rm") or name in labels[:i]:
                why = "is taken by the built-in rule/reward model" if name in ("rule", "rm") else "appears twice"
                raise ValueError(f"reward.functions[{i}].name {name!r} {why}; each function's name names its metrics "
                                 "(wrap one in a function of another name)")
        if self.accuracy not in ("auto", "rule", *labels):
            raise ValueError(f"reward.accuracy {self.accuracy!r} is not auto, rule or one of reward.functions' names "
                             f"({', '.join(labels) or 'none configured'})")
        return self


class ScoreConfig(_Section):
    n: int = Field(8, ge=1)
    """Responses sampled per prompt to score the SFT policy."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature for scoring."""
    filter_trivial: bool = True
    """Drop prompts whose mean reward is 0 or 1 before PPO (they carry no group signal)."""


class KLControlConfig(_Section):
    type: str = "fixed"
    """fixed or adaptive (Ziegler et al. 2019)."""
    kl_coef: float = Field(0.001, ge=0)
    """Initial (or fixed) coefficient of the KL penalty in the reward."""
    target_kl: float = Field(0.1, gt=0)
    """Adaptive controller target."""
    horizon: int = Field(10000, ge=1)
    """Adaptive controller horizon."""

    @field_validator("type")
    @classmethod
    def _known(cls, v: str) -> str:
        return names.check_name("KL controller", v, names.KL_CONTROLLERS)


class AlgorithmConfig(_Section):
    adv_estimator: str = Field("grpo", description=(
        f"Advantage estimator from rlcore.algos.advantage.ESTIMATORS: {', '.join(names.ADV_ESTIMATORS)} (gae trains a "
        "critic; the optimal token baselines add a log-prob forward per step for sum pi^2; distill is on-policy "
        "distillation from the teacher of the distill section)."))
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides by the group std; False gives Dr. GRPO."""
    use_kl_in_reward: bool = False
    """Subtract kl_coef * KL(actor || ref) from token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty."""
    kl_ctrl: KLControlConfig = KLControlConfig()
    """Controller of the in-reward KL coefficient."""
    gdpo_batch_norm: bool = True
    """adv_estimator gdpo: whiten the weighted sum of the per-component group-normalised advantages over the
    batch's valid tokens (the GDPO paper's last step). False keeps the sum: with one reward component, gdpo is then
    grpo exactly."""
    handle_zero_tail: bool = True
    """adv_estimator optimal_token_baseline / tir_optimal_token_baseline: where a group's longest response runs
    past every other one, its baseline there is 0 (verl's default) instead of its own reward-to-go."""

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        return names.check_name("advantage estimator", v, names.ADV_ESTIMATORS)

    @field_validator("kl_penalty")
    @classmethod
    def _known_kl(cls, v: str) -> str:
        return names.check_name("KL estimator", v, names.KL_ESTIMATORS)


class DistillConfig(_Section):
    teacher: str = Field("models/sft", min_length=1)
    """algorithm.adv_estimator distill: the teacher, a local Hugging Face causal-LM folder with the student's tokenizer
    (any model folder, or one another pipeline wrote, e.g. the default pipeline's models/ppo/r1 copied aside). A DVC
    dependency of the PPO rounds (dvc.yaml), so it may not be a folder one of this pipeline's rounds writes
    (models/ppo/<round>); read only by an estimator that takes a teacher."""
    reward_weight: float = Field(0.0, ge=0, allow_inf_nan=False)
    """algorithm.adv_estimator distill: weight of the task reward's GRPO advantage added to each token's teacher
    signal (log pi_teacher - log pi_student of the token the student sampled); 0 = the teacher's signal alone."""
    micro_batch_size: int = Field(256, ge=1)
    """Sequences per teacher log-prob forward on one rank (the teacher's worker group sits beside the actor's)."""


class OffPolicyConfig(_Section):
    correction: Literal["none", "tis", "mis", "icepop"] = "none"
    """Importance correction between the behaviour policy (the rollout's log-probs) and the proximal policy (the
    trainer's recomputed old log-probs; needs actor.recompute_log_prob or ppo.mode async with max_staleness > 0).
    tis: each token's loss times min(ratio, cap) (truncated IS). mis: sequences whose IS ratio (product over
    tokens) is outside [low, high] get weight 0 (sequence-level masking). icepop: tokens whose ratio is outside
    [low, high] get weight 0. none: no weights (the PPO ratio still uses the proximal policy)."""
    cap: float = Field(2.0, gt=0)
    """tis: largest token weight."""
    low: float = Field(0.5, ge=0)
    """mis/icepop: smallest ratio kept."""
    high: float = Field(2.0, gt=0)
    """mis/icepop: largest ratio kept."""

    @model_validator(mode="after")
    def _bounds(self) -> "OffPolicyConfig":
        if self.low >= self.high:
            raise ValueError(f"actor.off_policy.low {self.low} must be below actor.off_policy.high {self.high}")
        return self


class PolicyLossConfig(_Section):
    """params.yaml ``actor.loss``: which policy loss, and every option a loss of
    ``rlcore.algos.losses.POLICY_LOSSES`` may take, each under the keyword the losses take it as (a loss's own options
    start with its name). The actor update hands this section to the loss as it is, its nulls filled
    (:meth:`resolved`); each loss reads the options its signature names."""

    name: str = Field("vanilla", description=(
        f"Policy loss from rlcore.algos.losses.POLICY_LOSSES: {', '.join(names.POLICY_LOSSES)}."))
    loss_agg_mode: str = Field("token-mean", description=(
        f"Loss aggregation from rlcore.algos.aggregation.LOSS_AGG_MODES: {', '.join(names.LOSS_AGG_MODES)} "
        "(gspo, geo_mean, sapo and luspo fix their own); the entropy and KL terms of the actor loss take it too."))
    loss_scale_factor: float | None = Field(None, gt=0)
    """Constant divisor of loss_agg_mode seq-mean-token-sum-norm (Dr. GRPO); null = task.max_response_length."""
    clip_ratio: float = Field(0.2, gt=0)
    """PPO clip epsilon (dppo_tv/dppo_kl: the divergence bound of the trust region, as in verl; its DPPO recipe
    uses 0.15 for TV and 0.05 for KL)."""
    clip_ratio_low: float | None = Field(None, gt=0)
    """Lower clip epsilon (null = clip_ratio); dppo_*: the bound for tokens with A <= 0."""
    clip_ratio_high: float | None = Field(None, gt=0)
    """Upper clip epsilon, DAPO clip-higher (null = clip_ratio); dppo_*: the bound for tokens with A > 0."""
    clip_ratio_c: float = Field(3.0, gt=1)
    """Dual-clip bound for negative advantages (dppo_*: the truncation of the importance ratio)."""
    clip_cov_ratio: float = Field(0.0002, gt=0, le=1)
    """clip_cov: share of valid tokens whose gradient is cut (Cui et al. 2025)."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the token covariance window of candidates."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the token covariance window of candidates."""
    kl_cov_ratio: float = Field(0.0002, gt=0, le=1)
    """kl_cov: share of valid tokens that get the KL penalty (Cui et al. 2025)."""
    ppo_kl_coef: float = Field(1.0, ge=0)
    """kl_cov: coefficient of the |log-ratio| penalty on the selected tokens."""
    sapo_tau_pos: float = Field(1.0, gt=0)
    """sapo: temperature of the soft gate for tokens with a positive advantage (Gao et al. 2025)."""
    sapo_tau_neg: float = Field(1.05, gt=0)
    """sapo: temperature of the soft gate for the other tokens (larger: their gradient fades faster)."""
    dro_beta: float = Field(0.05, gt=0)
    """dro: coefficient of the quadratic penalty beta / 2 (log pi - log pi_old)^2."""
    vespo_k_pos: float = Field(2.0, ge=0)
    """vespo: power k of the gamma weight e^lambda w^k e^(-lambda w) for advantages >= 0."""
    vespo_lambda_pos: float = Field(3.0, gt=0)
    """vespo: decay lambda of the gamma weight for advantages >= 0."""
    vespo_k_neg: float = Field(3.0, ge=0)
    """vespo: power k for negative advantages."""
    vespo_lambda_neg: float = Field(2.0, gt=0)
    """vespo: decay lambda for negative advantages."""
    bypass_loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """bypass_mode (verl's rollout correction without a proximal forward: the rollout's log-probs are the old
    policy; needs actor.recompute_log_prob false and actor.off_policy.correction none): ppo_clip = PPO's clipped
    surrogate against the rollout policy (the ratio is the importance correction; the weights below are only
    reported); reinforce = the policy gradient times the importance weights."""
    bypass_is: Literal["none", "token", "sequence"] = "sequence"
    """bypass_mode: importance weights pi / pi_rollout per token, per sequence (product over its tokens) or none
    (verl's rollout_is)."""
    bypass_is_threshold: float = Field(2.0, gt=0)
    """bypass_mode: weights above it are truncated to it (TIS), or, with bypass_is_threshold_low, set to 0."""
    bypass_is_threshold_low: float | None = Field(None, gt=0)
    """bypass_mode: set, weights outside [bypass_is_threshold_low, bypass_is_threshold] become 0 (IcePop); null =
    truncation only."""
    bypass_rs: Literal[names.REJECTION_OPTIONS] | None = None  # type: ignore[valid-type]
    """bypass_mode: rejection test (verl's rollout_rs) of k1 = -log r, k2 = (log r)^2 / 2 or k3 = r - 1 - log r
    (r = pi / pi_rollout): token_k* per token, seq_sum_k* and seq_mean_k* over a sequence's tokens, seq_max_k2/k3
    their largest; a rejected token's loss is 0. null = off."""
    bypass_rs_threshold: float = Field(2.0, gt=0)
    """bypass_mode: bypass_rs's upper bound (a ratio for the *_k1 tests, a divergence otherwise)."""
    bypass_rs_threshold_low: float | None = Field(None, gt=0)
    """bypass_mode: the *_k1 tests' lower ratio bound; null = 1 / bypass_rs_threshold."""

    @field_validator("name", "loss_agg_mode")
    @classmethod
    def _registered(cls, v: str, info: ValidationInfo) -> str:
        kind, allowed = {"name": ("policy loss", names.POLICY_LOSSES),
                         "loss_agg_mode": ("loss aggregation mode", names.LOSS_AGG_MODES)}[str(info.field_name)]
        return names.check_name(kind, v, allowed)

    @model_validator(mode="after")
    def _bands(self) -> "PolicyLossConfig":
        if self.bypass_is_threshold_low is not None and self.bypass_is_threshold_low > self.bypass_is_threshold:
            raise ValueError(f"actor.loss.bypass_is_threshold_low {self.bypass_is_threshold_low} must not exceed "
                             f"actor.loss.bypass_is_threshold {self.bypass_is_threshold}")
        if self.bypass_rs_threshold_low is not None:
            if self.bypass_rs is None or not self.bypass_rs.endswith("k1"):
                raise ValueError(f"actor.loss.bypass_rs_threshold_low is set but actor.loss.bypass_rs is "
                                 f"{self.bypass_rs}; it only applies to the *_k1 tests")
            if self.bypass_rs_threshold_low > self.bypass_rs_threshold:
                raise ValueError(f"actor.loss.bypass_rs_threshold_low {self.bypass_rs_threshold_low} must not exceed "
                                 f"actor.loss.bypass_rs_threshold {self.bypass_rs_threshold}")
        return self

    def resolved(self, response_length: int) -> "PolicyLossConfig":
        """This section with its nulls filled as their docs say: the clip bounds from clip_ratio, the
        seq-mean-token-sum-norm divisor from the task's response length (``response_length``)."""
        return self.model_copy(update={
            "clip_ratio_low": self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low,
            "clip_ratio_high": self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high,
            "loss_scale_factor": self.loss_scale_factor or float(response_length)})


# actor keys that moved into actor.loss (old key -> its key there; None: a section whose keys moved one by one)
MOVED_TO_LOSS = {"policy_loss": "name", "bypass": None, **{k: k for k in (
    "loss_agg_mode", "loss_scale_factor", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
    "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "sapo_tau_pos", "sapo_tau_neg",
    "dro_beta", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")}}
# actor.bypass's keys -> their keys in actor.loss
MOVED_FROM_BYPASS = {"loss_type": "bypass_loss_type", "rollout_is": "bypass_is", "is_threshold": "bypass_is_threshold",
                     "is_threshold_low": "bypass_is_threshold_low", "rollout_rs": "bypass_rs",
                     "rs_threshold": "bypass_rs_threshold", "rs_threshold_low": "bypass_rs_threshold_low"}


def moved_actor_key(data: dict[str, Any]) -> str | None:
    """One line naming the first key of a params ``actor`` mapping that now lives in ``actor.loss``, and where."""
    for old, new in MOVED_TO_LOSS.items():
        if old not in data:
            continue
        if new is not None:
            return f"actor.{old} is now actor.loss.{new}"
        inner = next(iter(data[old]), None) if isinstance(data[old], dict) else None
        if inner in MOVED_FROM_BYPASS:
            return f"actor.bypass.{inner} is now actor.loss.{MOVED_FROM_BYPASS[inner]}"
        return "actor.bypass's keys are now actor.loss.bypass_* (rollout_is -> bypass_is, rollout_rs -> bypass_rs)"
    return None


class ActorConfig(OptimizerSettings, defaults={
        "lr": (1e-4, "AdamW learning rate of the policy. On the default task 3e-4 gained on some seeds and lost on "
                     "others; 1e-3 collapses."),
        "max_nonfinite_steps": (..., "Consecutive optimizer steps skipped for a NaN or infinite loss or gradient norm "
                                   "after which the round stops (exit code 3; the message names the step and the "
                                   "last finite metrics). A skipped step changes nothing (weights, optimizer state, "
                                   "learning-rate schedule); each PPO step logs how many of its optimizer steps it "
                                   "skipped (``actor/nonfinite_steps``), and the count runs over consecutive PPO "
                                   "steps that skipped any. 0 = never stop.")}):
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps (constant afterwards)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each rollout batch."""
    ppo_mini_batch_size: int = Field(16, ge=1)
    """Prompts per optimizer step (times rollout.n responses)."""
    micro_batch_size: int = Field(256, ge=1)
    """Sequences per forward/backward on one rank."""
    loss: PolicyLossConfig = PolicyLossConfig()
    """The policy loss and its options (rlcore.algos.losses)."""
    use_kl_loss: bool = True
    """Add kl_loss_coef * KL(actor || ref) to the loss (GRPO style)."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator for the loss term."""
    kl_loss_coef: float = Field(0.001, ge=0)
    """Weight of the KL loss term."""
    entropy_coeff: float = Field(0.0, ge=0)
    """Entropy bonus weight."""
    recompute_log_prob: bool = False
    """Recompute old log-probs with a training forward; False reuses the rollout's (same weights, same dtype).
    When on, ``rollout/logprob_abs_diff_mean`` / ``_max`` and ``rollout/logprob_k3_kl`` report how far the
    rollout engine's log-probs are from the trainer's for the same tokens."""
    off_policy: OffPolicyConfig = OffPolicyConfig()
    """Correction of the mismatch between the policy that sampled (rollout engine, older versions in async mode)
    and the one being trained."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations during backward instead of keeping them from the forward:
    the same gradients, less activation memory, about one more forward of compute per update."""
    lora: LoraSettings = LoraSettings()
    """LoRA adapters (rank 0 = off: full fine-tuning)."""

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and (line := moved_actor_key(data)):
            raise ValueError(line)
        return data

    @field_validator("kl_loss_type")
    @classmethod
    def _known_kl(cls, v: str) -> str:
        return names.check_name("KL estimator", v, names.KL_ESTIMATORS)


class CriticConfig(OptimizerSettings, defaults={
        "lr": (3e-3, "AdamW learning rate of the value model (used by gae)."),
        "max_nonfinite_steps": (..., "As actor.max_nonfinite_steps, for the critic's optimizer steps "
                                   "(``critic/nonfinite_steps``).")}):
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    ppo_mini_batch_size: int | None = Field(None, ge=1)
    """Prompts per critic optimizer step (times rollout.n responses); null = actor.ppo_mini_batch_size."""
    cliprange_value: float = Field(0.5, gt=0)
    """Value clipping range."""
    warmup_steps: int = Field(0, ge=0)
    """Steps during which only the critic trains."""
    micro_batch_size: int = Field(256, ge=1)
    """Sequences per value forward and per forward/backward on one rank."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations during backward instead of keeping them from the forward:
    the same gradients, less activation memory, about one more forward of compute per update."""
    lora: LoraSettings = LoraSettings()
    """LoRA adapters on the value model (rank 0 = off); its value head always trains fully."""


class DAPOConfig(_Section):
    dynamic_sampling: bool = False
    """Drop groups whose rewards are all equal and keep sampling until the batch is full."""
    max_sample_tries: int = Field(4, ge=1)
    """Cap on generation rounds per step under dynamic sampling."""
    overlong_buffer: int = Field(0, ge=0)
    """Soft overlong punishment window in tokens before max_response_length (0 = off)."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Largest penalty, reached at max_response_length."""


class AsyncConfig(_Section):
    queue_size: int = Field(2, ge=1)
    """ppo.mode async: step batches the rollout queue holds; a generator whose batch finds it full waits
    (back-pressure)."""
    max_staleness: int = Field(1, ge=0)
    """ppo.mode async: most policy versions a sample may lag the trainer. A step's batch is only started once the
    trainer is at most this many updates away from it, so generators pause rather than produce samples that
    would be too old; a batch that still arrives older (generators racing) is dropped and counted. 0 = on-policy:
    generation and training alternate, exactly as ppo.mode sync."""
    max_generator_restarts: int = Field(3, ge=0)
    """ppo.mode async: generators that died are restarted (and their batches generated again) this many times in a
    round; after that the round goes on with the generators left, and stops when none is."""
    schedule: Literal["free", "fixed"] = "free"
    """ppo.mode async: which policy version generates each batch. free: the newest one a generator finds when it
    starts the batch (within max_staleness), so which one it is depends on timing and a run with max_staleness > 0
    is not repeatable bit for bit. fixed: batch k is always generated by version max(0, k - max_staleness)
    (generators wait for that version, the trainer for that batch): every run gives the same bits, and a killed
    round resumes to them (a step checkpoint keeps the batches generated for older versions)."""
    partial_rollout: bool = False
    """ppo.mode async, schedule free, max_staleness >= 1: a generator takes a newer policy version between the decode
    steps of a batch in flight (the running rows' KV cache recomputed with the new weights) instead of finishing the
    batch on the weights it started with; each token keeps the version and log-prob it was sampled with, which the
    off-policy correction weighs token by token (AReaL's interruptible generation). Static engine, single-turn."""


class RewardModelTraining(_Section):
    train: str = Field(min_length=1)
    """Preference pairs to train on (.jsonl/.parquet: prompt, chosen, rejected, optional margin; prompt as text or
    chat messages, chosen/rejected as text or messages ending with the assistant's). data/processed/pairs_train.parquet
    is the built-in task's (task.pairs)."""
    test: str = Field(min_length=1)
    """Held-out pairs for rm/accuracy and the other metrics."""
    init: str = Field("models/sft", min_length=1)
    """Model folder the reward model starts from (its backbone; the score head is new)."""
    self_play: int = Field(0, ge=0)
    """Self-generated negatives (SPIN, Chen et al. 2024): this many samples of the init model per training prompt;
    each one that differs from the pair's chosen answer is added as a pair (chosen, sample), so the reward model
    learns to rank the answer above the policy's own mistakes. 0 = off."""


class RMConfig(OptimizerSettings, defaults={
        "lr": (2e-3, "Peak AdamW learning rate (linear warm-up, cosine decay to 10%).")}):
    models: dict[str, RewardModelTraining] = {}
    """Reward models to train: name -> {train, test, init}; dvc.yaml makes one stage per key (rm@<name>) writing
    models/rm/<name>, none while it is empty. Use one with reward.model.path: models/rm/<name>."""
    steps: int = Field(2000, ge=1)
    """Optimizer steps."""
    batch_size: int = Field(64, ge=1)
    """Pairs per step across all ranks (divisible by resources.n_workers)."""
    micro_batch_size: int = Field(64, ge=1)
    """Pairs per forward/backward on one rank."""
    warmup_steps: int = Field(20, ge=0)
    """Linear warm-up steps."""
    center_rewards_coefficient: float = Field(0.01, ge=0)
    """Weight of mean((r_chosen + r_rejected)^2) in the loss, which keeps scores centred on 0 (TRL's
    center_rewards_coefficient; Eisenstein et al. 2023). 0 = off."""
    eval_every: int = Field(250, ge=0)
    """Held-out accuracy every N steps (rm/val_accuracy in the plot and MLflow); 0 = only at the end."""
    save_every: int = Field(200, ge=0, json_schema_extra=KEEPS_STEPS)
    """Step checkpoint every N steps, per reward model (rlcore.trainer.loop.checkpoint, under checkpoint.dir/rm@<name>);
    a re-run after a crash or a stop resumes from the last one. 0 = off."""


class PPORound(_Section):
    init: str
    """Model folder the round starts from (the previous round's output)."""
    steps: int = Field(ge=1)
    """RL steps in this round."""


class PPOConfig(_Section):
    train_batch_size: int = Field(32, ge=1)
    """Prompts per RL step."""
    rounds: dict[str, PPORound] = {"r1": PPORound(init="models/sft", steps=400)}
    """Rounds in order; dvc.yaml makes one stage per key (ppo@r1, ...)."""
    dapo: DAPOConfig = DAPOConfig()
    """DAPO recipe tricks."""
    mode: str = "sync"
    """sync: the trainer's ranks generate each step's batch, then train on it (on-policy, colocated). async:
    rollout.n_workers generator workers fill a bounded queue while the trainer trains (ppo.async), with
    versioned weights and actor.off_policy corrections (rlcore.trainer.round.async_source)."""
    async_: AsyncConfig = Field(AsyncConfig(), alias="async")
    """Asynchronous rounds (ppo.mode async)."""
    save_every: int = Field(50, ge=0, json_schema_extra=KEEPS_STEPS)
    """Step checkpoint every N steps of a round (rlcore.trainer.loop.checkpoint); a re-run after a crash resumes from
    the last one. 0 = off."""
    log_samples: int = Field(8, ge=0)
    """Rollouts kept per step for inspection (prompt, response, reward, advantage, length, log-prob, policy
    version): rewritten after every step to the round's parquet ``metrics/ppo_<round>_rollouts.parquet``
    and logged to MLflow at the end, as the table ``rollout_samples.json`` and the page ``rollouts.html``
    (``rlcore view`` renders the same page from the parquet); 0 = none."""
    balance_batch: bool = True
    """Reorder each step's groups so every data-parallel rank gets about the same number of tokens
    (rlcore.controller.balance); ranks then wait less for each other in the log-prob and update calls."""
    val_every: int = Field(50, ge=0)
    """Greedy pass@1 on the held-out test split every N steps and after the last (``val/*`` metrics); 0 = off.
    Reported only: nothing is selected on it."""

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, v: str) -> str:
        return names.check_name("ppo mode", v, names.PPO_MODES)


class EvaluateConfig(_Section):
    final_round: str = "r1"
    """Round whose model is compared with the SFT model."""
    k: int = Field(8, ge=1)
    """Sampled pass@k."""
    n_samples: int = Field(8, ge=1)
    """Samples per prompt for pass@k (>= k; unbiased estimator)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature for pass@k."""
    table_rows: int = Field(16, ge=0)
    """Prompts in the sample table logged to MLflow."""

    @model_validator(mode="after")
    def _enough_samples(self) -> "EvaluateConfig":
        if self.n_samples < self.k:
            raise ValueError(f"evaluate.n_samples {self.n_samples} must be >= evaluate.k {self.k}")
        return self


class Config(_Section):
    seed: int = 42
    """Seed of data generation, model init, sampling and shuffling."""
    ray: RayConfig = Field(RayConfig(), json_schema_extra=KEEPS_STEPS)
    tracking: TrackingConfig = Field(TrackingConfig(), json_schema_extra=KEEPS_STEPS)
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    resources: ResourcesConfig = ResourcesConfig()
    sft: SFTConfig = SFTConfig()
    checkpoint: CheckpointConfig = Field(CheckpointConfig(), json_schema_extra=KEEPS_STEPS)
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    score: ScoreConfig = ScoreConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    distill: DistillConfig = DistillConfig()
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig = CriticConfig()
    rm: RMConfig = RMConfig()
    ppo: PPOConfig = PPOConfig()
    evaluate: EvaluateConfig = EvaluateConfig()

    @model_validator(mode="after")
    def _cross_checks(self) -> "Config":
        w = self.resources.n_workers
        if self.sft.batch_size % w:
            raise ValueError(f"sft.batch_size {self.sft.batch_size} must be divisible by resources.n_workers {w}")
        for role in ("actor", "critic"):
            mini = getattr(self, role).ppo_mini_batch_size
            if mini is None:
                continue
            if self.ppo.train_batch_size % mini:
                raise ValueError(f"ppo.train_batch_size {self.ppo.train_batch_size} must be divisible by "
                                 f"{role}.ppo_mini_batch_size {mini}")
            if (mini * self.rollout.n) % w:
                raise ValueError(f"{role}.ppo_mini_batch_size * rollout.n = {mini * self.rollout.n} "
                                 f"must be divisible by resources.n_workers {w}")
        if self.ppo.mode == "async":
            self._async_checks()
        elif self._separate_rm_cpus() and self.ray.address == "local":
            need = w * self.resources.cpus_per_worker + self._separate_rm_cpus()
            if need > self.ray.num_cpus:
                raise ValueError(f"reward.model.placement separate needs resources.n_workers * cpus_per_worker + "
                                 f"reward.model.cpus = {need:g} CPUs, more than ray.num_cpus {self.ray.num_cpus}")
        if self.actor.loss.name in names.BEHAVIOUR_OLD_POLICY_LOSSES:
            if self.actor.recompute_log_prob:
                raise ValueError(f"actor.loss.name {self.actor.loss.name} takes the rollout's log-probs as the old "
                                 "policy: set actor.recompute_log_prob: false")
            if self.actor.off_policy.correction != "none":
                raise ValueError(f"actor.loss.name {self.actor.loss.name} corrects for the rollout policy itself "
                                 f"(actor.loss.bypass_*): set actor.off_policy.correction: none")
        if self.actor.off_policy.correction != "none" and not needs_recompute(self.actor, self.ppo):
            raise ValueError(f"actor.off_policy.correction {self.actor.off_policy.correction} compares the rollout's "
                             f"log-probs with recomputed ones: set actor.recompute_log_prob: true (or use ppo.mode "
                             f"async with ppo.async.max_staleness > 0)")
        if self.rollout.engine == "vllm":
            self._vllm_checks()
        if self.algorithm.adv_estimator in names.TEACHER_ESTIMATORS:
            self._distill_checks()
        if self.ppo.async_.partial_rollout:
            self._partial_rollout_checks()
        if self.evaluate.final_round not in self.ppo.rounds:
            raise ValueError(
                f"evaluate.final_round {self.evaluate.final_round!r} is not a key of ppo.rounds "
                f"({', '.join(self.ppo.rounds)})"
            )
        return self

    def _vllm_checks(self) -> None:
        """What rollout.engine vllm cannot run, known before any stage starts (rlcore.rollout.vllm_engine)."""
        if self.rollout.agent.loop == "tool":
            raise ValueError("rollout.engine vllm does not run rollout.agent.loop tool (the agent loop samples from "
                             "full logits, which vLLM does not hand out): use rollout.engine static or hf, or "
                             "rollout.agent.loop openai (an agent program; whole turns per engine call)")
        if self.model.dtype == "float16" and not self.resources.use_gpu:
            raise ValueError("rollout.engine vllm runs float32 or bfloat16 on a CPU: model.dtype float16 needs "
                             "resources.use_gpu true")
        if not self.resources.use_gpu:  # vLLM's CPU attention; its GPU backends take the common head dims
            head_dim, where = model_head_dim(self.model)
            if head_dim is not None and head_dim not in names.VLLM_CPU_HEAD_DIMS:
                raise ValueError(f"rollout.engine vllm: {where} has head_dim {head_dim}, which vLLM's CPU attention "
                                 f"does not run (it runs {', '.join(map(str, names.VLLM_CPU_HEAD_DIMS))}): use "
                                 f"rollout.engine static or hf, or a model whose head_dim it runs (the built-in one: "
                                 f"model.tiny.num_heads 2, heads of 32)")

    def _distill_checks(self) -> None:
        """A teacher the rounds depend on (dvc.yaml) must not be one of their own outputs: DVC would refuse the cycle
        with less to go on."""
        teacher = Path(self.distill.teacher)
        for name in self.ppo.rounds:
            if teacher == Path("models/ppo") / name:
                raise ValueError(f"distill.teacher {self.distill.teacher} is what round ppo.rounds.{name} writes, and "
                                 "every round depends on the teacher: copy that model aside (e.g. cp -r "
                                 f"{self.distill.teacher} models/teacher) or name this pipeline's rounds otherwise")

    def _partial_rollout_checks(self) -> None:
        """What ppo.async.partial_rollout needs: a generator that can take new weights between decode steps."""
        a, why = self.ppo.async_, "ppo.async.partial_rollout"
        if self.ppo.mode != "async":
            raise ValueError(f"{why} interrupts the generators of ppo.mode async: set ppo.mode async")
        if a.schedule == "fixed":
            raise ValueError(f"{why} takes whichever policy version is newest mid-batch, which depends on timing: it "
                             "cannot run with ppo.async.schedule fixed (the same bits on every run)")
        if a.max_staleness == 0:
            raise ValueError(f"{why} with ppo.async.max_staleness 0 has nothing to interrupt (no newer version is "
                             "published while a batch is generated): raise max_staleness or turn it off")
        if self.rollout.engine != "static":
            raise ValueError(f"{why} needs rollout.engine static (its decode loop takes new weights between steps), "
                             f"not {self.rollout.engine}")
        if self.rollout.agent.loop != "single_turn":
            raise ValueError(f"{why} runs single-turn rollouts: set rollout.agent.loop single_turn")

    def _separate_rm_cpus(self) -> float:
        rm = self.reward.model
        return rm.cpus if rm is not None and rm.placement == "separate" else 0.0

    def _async_checks(self) -> None:
        """What ppo.mode async cannot do, and the resources it needs on a local Ray."""
        if self.ppo.dapo.dynamic_sampling:
            raise ValueError("ppo.dapo.dynamic_sampling is not supported with ppo.mode async (set it to false or use "
                             "ppo.mode sync)")
        if self.algorithm.adv_estimator in names.GREEDY_BASELINE_ESTIMATORS:
            raise ValueError(f"algorithm.adv_estimator {self.algorithm.adv_estimator} (a greedy baseline per step) is "
                             "not supported with ppo.mode async; use ppo.mode sync")
        r, g = self.resources, self.rollout
        need = r.n_workers * r.cpus_per_worker + g.n_workers * g.cpus_per_worker + self._separate_rm_cpus()
        if self.ray.address == "local" and need > self.ray.num_cpus:
            raise ValueError(f"ppo.mode async needs resources.n_workers * cpus_per_worker + rollout.n_workers * "
                             f"cpus_per_worker (+ reward.model.cpus, placement separate) = {need:g} CPUs, more than ray.num_cpus {self.ray.num_cpus} (trainer and "
                             f"generators get their own bundles): lower resources.n_workers or raise ray.num_cpus")


def needs_recompute(actor: ActorConfig, ppo: PPOConfig) -> bool:
    """Whether a round's old (proximal) log-probs are the trainer's own, recomputed, rather than the rollout's: asked
    for (``actor.recompute_log_prob``), or an asynchronous round whose batches may come from older weights
    (``ppo.async.max_staleness`` > 0). The one rule for the config's checks and the round's choice of source."""
    return actor.recompute_log_prob or (ppo.mode == "async" and ppo.async_.max_staleness > 0)


def model_head_dim(model: ModelConfig) -> tuple[int | None, str]:
    """The attention head width of the model params.yaml names, and what to call it in a message: the built-in
    model's from its shape, a local folder's from its config.json (None where it has none to read: a model stage
    outputs later, or an adapter folder whose base says it)."""
    if model.path == "tiny":
        t = model.tiny
        return t.hidden_size // t.num_heads, (f"model.tiny (hidden_size {t.hidden_size} / num_heads "
                                              f"{t.num_heads})")
    config = Path(model.path) / "config.json"
    try:
        c = json.loads(config.read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None, str(config)
    return int(head_dim), f"model.path {model.path}"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-5`` as a number as YAML 1.2 (and DVC, which writes ``dvc exp run -S``
    values so) does; YAML 1.1 wants a dot (``1.0e-5``) and reads it as text."""


_EXPONENT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")  # 1e-5, 3E+2 (YAML 1.1 needs a dot)
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT, list("-+0123456789"))


def read_yaml(text: str) -> Any:
    """A params file's (or a ``--set`` value's) YAML, with numbers as YAML 1.2 reads them."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the section at ``loc`` (a path into the params: names, list indices, mapping keys) accepts."""
    model: Any = Config
    parts = list(loc)
    while parts:
        origin = typing.get_origin(model)
        if origin in (typing.Union, types.UnionType):  # an optional section: the section
            model = next(a for a in typing.get_args(model) if a is not type(None))
        elif origin in (list, dict):  # an item of a list or a mapping: its index or key is the next part
            model, parts = typing.get_args(model)[-1], parts[1:]
        elif isinstance(model, type) and issubclass(model, BaseModel):
            part = parts.pop(0)
            model = next((f.annotation for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        else:
            return []
    if typing.get_origin(model) in (typing.Union, types.UnionType):
        model = next(a for a in typing.get_args(model) if a is not type(None))
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []
    return [f.alias or n for n, f in model.model_fields.items()]


def _quoted_number(value: Any, kind: str) -> bool:
    """Whether ``value`` is text that, unquoted, would have been the ``kind`` (int_type, ...) the key wants."""
    if not isinstance(value, str):
        return False
    try:
        unquoted = read_yaml(value)
    except yaml.YAMLError:
        return False
    wanted = {"int_type": int, "float_type": (int, float), "bool_type": bool}[kind]
    return isinstance(unquoted, wanted) and (kind == "bool_type" or not isinstance(unquoted, bool))


def _format_error(err: ValidationError, source: str) -> str:
    """Render the first pydantic error as one line: file, dotted key, bad value, expectation (and the closest known
    keys to an unknown one; that a quoted number is text). An unknown key comes first: a misspelt key also leaves
    its right spelling missing."""
    errors = err.errors(include_url=False)
    e = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
    key = ".".join(str(p) for p in e["loc"]) or "<root>"
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(e["loc"][-1]), _keys_at(e["loc"][:-1]), n=3)
        parent = key[:len(key) - len(str(e["loc"][-1]))]
        hint = f"; did you mean {' or '.join(parent + c for c in close)}?" if close else ""
        return f"{source}: unknown key '{key}'{hint}"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    if e["type"] == "missing":
        return f"{source}: {key} is required (it has no default){more}"
    if isinstance(e.get("input"), dict):  # a cross-field check: its message names the keys
        return f"{source}: {msg}{more}"
    if e["type"] in ("int_type", "float_type", "bool_type") and _quoted_number(e.get("input"), e["type"]):
        msg += " (a quoted value is text: write it without quotes)"
    return f"{source}: {key} = {e.get('input')!r}: {msg}{more}"


def parse_config(raw: dict[str, Any] | None, source: str = "params.yaml") -> Config:
    """Validate a params mapping; raise ConfigError with one line naming the key."""
    try:
        return Config.model_validate(raw or {})
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def load_config(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Config:
    """Read params.yaml (missing file -> ConfigError naming it), apply dotted overrides, validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: params file not found")
    try:
        raw = read_yaml(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return parse_config(apply_overrides(raw, overrides or {}), str(path))


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set each dotted key of ``overrides`` (``{"rollout.top_p": 0.9}``) in the raw params mapping."""
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for i, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: {'.'.join(parents[:i + 1])} is a value, not a section")
        node[leaf] = value
    return raw


def section_dict(cfg: Config, sections: tuple[str, ...]) -> dict[str, Any]:
    """The chosen sections (top-level, or a part of one as ``rollout.agent``) as plain JSON-able data, nested as in
    params.yaml."""
    data = cfg.model_dump(mode="json")
    out: dict[str, Any] = {}
    for s in sections:
        *parents, last = s.split(".")
        src, dst = data, out
        for p in parents:
            src, dst = src[p], dst.setdefault(p, {})
        dst[last] = json.loads(json.dumps(src[last]))
    return out


def step_params(params: dict[str, Any], schema: type[BaseModel] = Config) -> dict[str, Any]:
    """``params`` (sections of ``schema`` as plain data, nested as in params.yaml) without the keys declared
    :data:`KEEPS_STEPS`: what the steps a stage has done depend on, its step checkpoints' fingerprint. A key that is
    not the schema's (a stage's recorded input hashes, ``reward_inputs``) is kept as it is."""
    fields = {field.alias or name: field for name, field in schema.model_fields.items()}
    out: dict[str, Any] = {}
    for key, value in params.items():
        field = fields.get(key)
        if field is None:
            out[key] = value
            continue
        if (field.json_schema_extra or {}) == KEEPS_STEPS:
            continue
        inner = field.annotation
        section = isinstance(inner, type) and issubclass(inner, BaseModel) and isinstance(value, dict)
        out[key] = step_params(value, inner) if section else value
    return out


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}, for MLflow params."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def params_hash(data: dict[str, Any]) -> str:
    """Stable short hash of a params mapping (tags runs that used the same params)."""
    blob = json.dumps(data, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]
