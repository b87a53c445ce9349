"""Batch generation to a file (``rlcore generate``; ``rlcore.rewards.generations`` scores such a file).

Generation runs on the same Ray worker group, engine and seeding as the score and evaluate stages
(:func:`rlcore.trainer.samples.generation.sample_chunks`): with the evaluate stage's settings (``--n``, ``--temperature``
and ``--seed`` = ``seed + 1``, the seed its sampled pass@k uses) on the test split, ``generate`` then
``eval`` gives exactly the stage's ``final/pass@1`` and ``pass@k`` on the same machine and resources.

Input rows are either the pipeline's row schema (``prompt`` is a list of chat messages; ``data_source``
and ``reward_model.ground_truth`` let ``eval`` score them) or plain rows of a jsonl file with a ``prompt``
string or ``messages`` list. Every input column is kept; generation adds, per prompt, the lists
``responses``, ``response_tokens``, ``response_logprobs`` (summed over the response, under
``softmax(logits / T)``) and ``finish_reasons`` (``stop`` at EOS, ``length`` at the token limit).

With the tool loop (``rollout.agent.loop: tool``) each response is a whole trajectory: ``responses`` holds its last
assistant turn (what ``rlcore eval`` scores), ``trajectories`` every turn after the prompt (``{"role", "content",
"name"}``: assistant turns, tool results), ``tool_calls`` the calls it made, ``response_tokens`` and
``response_logprobs`` count the model's own tokens, and ``finish_reasons`` is ``stop`` (it answered), ``length``
(the token budget ran out) or ``max_turns`` (it still called a tool at the last allowed turn).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from rlcore.agents.check import check_agent_program, tool_schemas
from rlcore.config import Config
from rlcore.engine.lora import architecture_folder
from rlcore.errors import DataError
from rlcore.rewards.generations import read_records

OUTPUT_COLUMNS = ("responses", "response_tokens", "response_logprobs", "finish_reasons")
AGENT_COLUMNS = ("trajectories", "tool_calls")  # with the tool loop, besides OUTPUT_COLUMNS
AGENT_FINISH = {"answer": "stop", "budget": "length", "max_turns": "max_turns", "failed": "failed"}
METADATA_KEY = b"rlcore.generate"


@dataclass(frozen=True)
class GenerateSettings:
    """One ``rlcore generate`` run."""

    n: int
    """Responses per prompt."""
    temperature: float
    """Sampling temperature; 0 is greedy decoding."""
    max_new_tokens: int
    seed: int


def chat_messages(row: Mapping[str, Any], where: str) -> list[dict[str, str]]:
    """The chat messages of one input row: ``prompt`` as a string (one user message) or a message list,
    or ``messages``."""
    value = row.get("prompt", row.get("messages"))
    if value is None:
        raise DataError(f"{where}: missing field 'prompt' (a string or a list of chat messages)")
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: field 'prompt' is empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(f"{where}: field 'prompt' should be a string or a non-empty list of messages, "
                        f"got {type(value).__name__}")
    for k, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: prompt[{k}] should be a message {{'role': str, 'content': str}}, got {m!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def model_context(model_dir: str | Path) -> int:
    """The longest sequence the model at ``model_dir`` accepts (its ``max_position_embeddings``; an adapter folder's
    base's)."""
    config = json.loads((architecture_folder(model_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)


def encode_for_generation(tokenizer, messages: list[list[dict[str, str]]], *, min_width: int, context: int,
                          max_new_tokens: int, source: str, tools: list[dict] | None = None):
    """Left-padded prompt ids and mask, as wide as the longest prompt (at least ``min_width``, the
    pipeline's ``task.max_prompt_length``), after checking each prompt leaves room for the response.
    ``tools``: the tool loop's function schemas, for chat templates that show them."""
    from rlcore.data.collate import encode_prompts

    longest = 0
    extra = {"tools": tools} if tools else {}
    for i, m in enumerate(messages):
        text = tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **extra)
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if length + max_new_tokens > context:
            raise DataError(f"{source}: row {i}: prompt is {length} tokens after the chat template; with "
                            f"{max_new_tokens} new tokens that exceeds the model's context of {context}")
        longest = max(longest, length)
    return encode_prompts(tokenizer, messages, max(min_width, longest), source, tools)


def generate_records(cfg: Config, *, model_dir: str, data_path: str, settings: GenerateSettings) -> list[dict]:
    """Input rows of ``data_path`` plus their generations (module docstring), from the model at
    ``model_dir`` on a Ray worker group of ``resources.n_workers`` ranks."""
    from rlcore.agents.batch import ROW_FIELDS
    from rlcore.engine.model import load_tokenizer
    from rlcore.protocol import Batch
    from rlcore.trainer.loop.pool import start_pool
    from rlcore.trainer.samples.generation import rollout_worker_group, sample_chunks

    check_agent_program(cfg.rollout.agent)  # an agent program's file, before Ray starts
    rows = read_records(data_path)
    messages = [chat_messages(r, f"{data_path}: row {i}") for i, r in enumerate(rows)]
    tokenizer = load_tokenizer(model_dir)
    ids, mask = encode_for_generation(tokenizer, messages, min_width=cfg.task.max_prompt_length,
                                      context=model_context(model_dir), max_new_tokens=settings.max_new_tokens,
                                      source=data_path, tools=tool_schemas(cfg.rollout.agent))
    # the row fields an environment's reset reads, where the rows have them (the pipeline's row schema), and the
    # messages (an agent program's row)
    fields: dict[str, Any] = {k: [r.get(k) for r in rows] for k in ROW_FIELDS if all(k in r for r in rows)}
    fields["messages"] = messages
    if "reward_model" in rows[0] and all(isinstance(r.get("reward_model"), dict) for r in rows):
        fields["ground_truth"] = [r["reward_model"].get("ground_truth") for r in rows]
    prompts = Batch({"prompts": ids, "prompt_mask": mask}, fields)
    greedy = settings.temperature == 0
    with start_pool(cfg) as pool:
        group = rollout_worker_group(cfg, pool, model_dir)
        try:
            gen = sample_chunks(cfg, group, prompts, n=settings.n, temperature=settings.temperature or 1.0,
                                greedy=greedy, seed=settings.seed, desc="generate",
                                max_new_tokens=settings.max_new_tokens)
        finally:
            group.shutdown()
    return generation_records(rows, gen, tokenizer, settings.n)


def generation_records(rows: list[dict], gen, tokenizer, n: int) -> list[dict]:
    """Each input row plus its ``n`` generations (module docstring) from the generated Batch ``gen``."""
    from rlcore.trainer.samples.scoring import response_texts

    resp_mask = gen["response_mask"]
    texts = response_texts(tokenizer, gen)
    lengths = resp_mask.sum(-1)
    logps = (gen["rollout_log_probs"] * resp_mask).sum(-1)
    if "agent_stop" in gen:
        finish = [AGENT_FINISH[s] for s in gen["agent_stop"]]
    else:
        last = gen["responses"].gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
        finish = ["stop" if s else "length" for s in ((lengths > 0) & (last == tokenizer.eos_token_id)).tolist()]
    out = []
    for i, row in enumerate(rows):
        part = slice(i * n, (i + 1) * n)
        record = {**row, "responses": texts[part], "response_tokens": lengths[part].tolist(),
                  "response_logprobs": logps[part].tolist(), "finish_reasons": finish[part]}
        if "agent_messages" in gen:
            record["trajectories"] = [[{"name": None, **m} for m in t] for t in gen["agent_messages"][part]]
            record["tool_calls"] = gen["agent_tool_calls"][part].tolist()
        if "agent_reward" in gen:  # an agent program's own rewards, which rlcore eval keeps
            record["agent_rewards"] = [None if r is None else float(r) for r in gen["agent_reward"][part]]
            record["agent_failures"] = list(gen["agent_failure"][part])
            record["agent_reward_extras"] = [json.dumps(e) for e in gen["agent_reward_extras"][part]]
        out.append(record)
    return out


def write_generations(records: list[dict], path: str | Path, meta: dict[str, Any]) -> None:
    """The generations parquet, with the run's settings in the file's metadata; written to a temporary
    name and renamed, so an interrupted write never leaves a partial file under ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(records)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), METADATA_KEY: json.dumps(meta).encode()})
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    tmp.replace(path)
