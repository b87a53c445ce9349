"""The model behind ``rlcore serve``: a tokenizer and a batched rollout engine, validated requests in, OpenAI
response bodies out (:class:`ModelServer`), and loading it from a model folder (:func:`load_server`)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlcore.agents.parsers import PARSERS, ToolCall
from rlcore.config import Config
from rlcore.rollout import RolloutEngine, engine_spec, make_engine
from rlcore.serve.batcher import Batcher, Busy, Rows, Sampling
from rlcore.serve.http import APIError
from rlcore.serve.schema import (GREEDY_BELOW, MAX_STOP_STRINGS, MIN_TEMPERATURE, UNSUPPORTED, ChatRequest,
                                 CompletionRequest, SamplingRequest)

log = logging.getLogger("rlcore.serve")


# ------------------------------------------------------------------------------------------------- model

@dataclass(frozen=True)
class ServeOptions:
    """How the server answers (the ``rlcore serve`` options)."""

    served_model_name: str
    max_batch_size: int = 64
    """Rows (completions) one engine call generates at most; also the most one request may ask for."""
    batch_wait_ms: float = 5.0
    """How long a request that finds the engine idle waits for others to share its call."""
    batching: bool = True
    """False: every request is its own engine call."""
    max_n: int = 16
    """The most completions per prompt (``n``) a request may ask for."""
    max_tokens: int = 1024
    """The most tokens one completion generates (``--max-tokens``); a request asking for more gets this many."""
    max_queue: int = 128
    """The most requests waiting for the engine (``--max-queue``); one more gets 503 with ``Retry-After``."""
    request_timeout_s: float = 600.0
    """Seconds from a request's arrival to its answer (``--request-timeout``); past it, 504."""
    max_body_bytes: int = 1 << 20
    """The largest request body (``--max-body-bytes``); a larger one gets 413 before it is read."""


@dataclass(frozen=True)
class _Output:
    text: str
    finish_reason: str
    tokens: list[int]
    """The tokens generated up to the finish (EOS included; none past a stop string)."""
    log_probs: list[float]


class ModelServer:
    """A tokenizer and a batched rollout engine: validated requests in, OpenAI response bodies out."""

    def __init__(self, tokenizer, engine: RolloutEngine, *, device: torch.device, context_length: int, vocab_size: int,
                 default_max_tokens: int, options: ServeOptions, seed: int = 0, tool_parser: str = "hermes"):
        self.tokenizer = tokenizer
        self.parser = PARSERS.get(tool_parser)
        # a template that renders an assistant's tool_calls itself gets them as data; others as the model wrote them
        self.template_renders_calls = "tool_calls" in str(getattr(tokenizer, "chat_template", "") or "")
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.default_max_tokens = default_max_tokens
        self.options = options
        self.name = options.served_model_name
        self.created = int(time.time())
        self.batcher = Batcher(engine, device=device, pad_token_id=tokenizer.pad_token_id,
                               max_batch_rows=options.max_batch_size, wait_s=options.batch_wait_ms / 1000,
                               batching=options.batching, seed=seed, max_waiting=options.max_queue)
        # tokenizing and chat templates run here, one at a time (a fast tokenizer is not safe to share between
        # threads), so a long prompt never holds up the event loop
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlcore-tokenize")
        self.counters = {"timeouts": 0, "internal_errors": 0, "temperatures_raised": 0}

    async def off_loop(self, fn, *args):
        """``fn(*args)`` in the tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn, *args)

    # -- validation ---------------------------------------------------------------------------------

    def check_request(self, req: SamplingRequest) -> None:
        choice = getattr(req, "tool_choice", None)
        if choice not in (None, "auto", "none"):
            raise APIError(400, f"tool_choice: only \"auto\" and \"none\" are supported by this server (got {choice!r})",
                           param="tool_choice")
        if req.model is not None and req.model != self.name:
            raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")
        for key, value in (req.model_extra or {}).items():
            if key in UNSUPPORTED and value not in UNSUPPORTED[key]:
                raise APIError(400, f"{key}: not supported by this server (got {value!r})", param=key)
        n = req.n or 1
        if n > self.options.max_n:
            raise APIError(400, f"n: at most {self.options.max_n} completions per prompt on this server (--max-n), "
                                f"got {n}", param="n")
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        if any(s == "" for s in stops):
            raise APIError(400, "stop: stop strings must not be empty", param="stop")
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")

    def check_rows(self, req: SamplingRequest, prompts: int) -> None:
        """``prompts`` x ``n`` completions fit one engine call: checked before any prompt is tokenized."""
        n = req.n or 1
        if n * prompts > self.options.max_batch_size:
            raise APIError(400, f"n: {prompts} prompt(s) x n={n} = {n * prompts} completions; this server "
                                f"generates at most {self.options.max_batch_size} per request (--max-batch-size)",
                           param="n")

    def sampling(self, req: SamplingRequest, prompts: list[list[int]], max_tokens: int | None, *,
                 max_tokens_param: str, prompt_param: str) -> Sampling:
        """The request's engine settings, once its prompts fit the model: ``max_tokens`` checked against the
        context, then capped at ``--max-tokens``; the temperature made safe (module constants)."""
        self.check_rows(req, len(prompts))
        longest = max(len(p) for p in prompts)
        ctx = self.context_length
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, ctx - longest)
            if max_tokens < 1:
                raise APIError(400, f"This model's maximum context length is {ctx} tokens; the prompt is {longest} "
                                    f"tokens, which leaves no room for a completion", param=prompt_param,
                               code="context_length_exceeded")
        elif longest + max_tokens > ctx:
            raise APIError(400, f"This model's maximum context length is {ctx} tokens; the prompt is {longest} tokens "
                                f"and {max_tokens_param} is {max_tokens} ({longest + max_tokens} in all). Shorten the "
                                f"prompt or lower {max_tokens_param}", param=max_tokens_param,
                           code="context_length_exceeded")
        return Sampling(max_tokens=min(max_tokens, self.options.max_tokens), temperature=self.temperature(req),
                        top_p=1.0 if req.top_p is None else req.top_p, top_k=max(req.top_k or 0, 0))

    def temperature(self, req: SamplingRequest) -> float:
        """The temperature the engine uses: 0 (greedy) under :data:`GREEDY_BELOW`, at least :data:`MIN_TEMPERATURE`
        otherwise (said once in the log, as vLLM warns)."""
        t = 1.0 if req.temperature is None else req.temperature
        if t < GREEDY_BELOW:
            return 0.0
        if t < MIN_TEMPERATURE:
            if not self.counters["temperatures_raised"]:
                log.warning("temperature %g is under %g, which overflows logits / temperature; raised to %g "
                            "(logged once)", t, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.counters["temperatures_raised"] += 1
            return MIN_TEMPERATURE
        return t

    @staticmethod
    def prompt_count(req: CompletionRequest) -> int:
        """How many prompts ``req.prompt`` holds, without tokenizing any."""
        p = req.prompt
        return 1 if isinstance(p, str) or (p and isinstance(p[0], int)) else len(p)

    def encode(self, text: str, where: str, **kwargs: Any) -> list[int]:
        """``text``'s token ids; text that is not valid Unicode (a lone surrogate, which JSON can spell) is a 400."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise APIError(400, f"{where}: not valid Unicode text ({err.reason} at character {err.start})",
                           param=where.split(".")[0]) from None
        return self.tokenizer(text, **kwargs)["input_ids"]

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [self.encode(p, "prompt")]
        elif not p:
            raise APIError(400, "prompt: expected at least one prompt, got an empty list", param="prompt")
        elif isinstance(p[0], int):
            prompts = [list(p)]
        elif isinstance(p[0], str):
            prompts = [self.encode(t, f"prompt.{i}") for i, t in enumerate(p)]
        else:
            prompts = [list(r) for r in p]
        for i, ids in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            if not ids:
                raise APIError(400, f"{where}: the prompt is empty (no tokens)", param="prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(400, f"{where}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               param="prompt")
        return prompts

    def chat_messages(self, req: ChatRequest) -> list[dict[str, Any]]:
        """The request's messages as the chat template takes them (module docstring: tool calls)."""
        out = []
        for i, m in enumerate(req.messages):
            content = m.content if isinstance(m.content, str) or m.content is None \
                else "".join(part.text for part in m.content)
            message: dict[str, Any] = {"role": m.role, "content": content}
            if m.tool_calls:
                calls = [ToolCall(c.function.name, self._arguments(c.function.arguments,
                                                                   f"messages.{i}.tool_calls.{j}.function.arguments"))
                         for j, c in enumerate(m.tool_calls)]
                if self.template_renders_calls:
                    message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                        "name": call.name, "arguments": call.arguments}} for c, call in zip(m.tool_calls, calls)]
                else:
                    message["content"] = (content or "") + self.parser.format(calls)
            message.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v is not None})
            out.append(message)
        return out

    @staticmethod
    def _arguments(text: str, where: str) -> dict[str, Any]:
        try:
            value = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise APIError(400, f"{where}: expected a JSON object as text, got {text[:60]!r}", param=where)
        return value

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        messages = self.chat_messages(req)
        tools = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if req.tools else {}
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **tools)
        except Exception as err:  # noqa: BLE001 - jinja errors, templates that raise on a role
            raise APIError(400, f"messages: the model's chat template failed on them: {err}",
                           param="messages") from None
        return self.encode(text, "messages", add_special_tokens=False)

    # -- generation -----------------------------------------------------------------------------------

    async def generate(self, rows: list[list[int]], sampling: Sampling, seed: int | None) -> Rows:
        try:
            return await self.batcher.generate(rows, sampling, seed)
        except Busy as busy:
            raise APIError(503, f"The server is busy: {busy.waiting} requests are waiting for the engine "
                                f"(--max-queue {self.options.max_queue}); retry after {busy.retry_after_s} s",
                           type="server_error", code="server_busy",
                           headers={"Retry-After": str(busy.retry_after_s)}) from None
        except Exception:  # noqa: BLE001 - answered as a 500 without internals; the scheduler goes on
            raise self.internal_error("generation failed") from None

    def internal_error(self, what: str, err: BaseException | None = None) -> APIError:
        """A 500 that names an error id and nothing else; the traceback (of ``err``, else of the exception being
        handled) goes to the log under that id."""
        error_id = uuid.uuid4().hex[:12]
        self.counters["internal_errors"] += 1
        log.error("%s (error id %s)", what, error_id, exc_info=err or True)
        return APIError(500, f"The server had an error while processing the request (error id {error_id}; the "
                             "server log has the details)", type="server_error")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def finish(self, tokens: list[int], log_probs: list[float], stops: list[str]) -> _Output:
        """Text and finish reason of one generated row, cut before the first stop string it completes."""
        eos = bool(tokens) and tokens[-1] == self.tokenizer.eos_token_id
        body = tokens[:-1] if eos else tokens
        text = self.decode(body)
        if not any(s in text for s in stops):
            return _Output(text, "stop" if eos else "length", tokens, log_probs)
        lo, hi = 1, len(body)  # the shortest prefix whose text holds a stop string: where a stream would stop
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in self.decode(body[:mid]) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        prefix = self.decode(body[:lo])
        cut = min(i for i in (prefix.find(s) for s in stops) if i >= 0)
        return _Output(prefix[:cut], "stop", body[:lo], log_probs[:lo])

    def token_texts(self, tokens: list[int]) -> list[str]:
        """Each token's own text (special tokens spelled out, e.g. EOS)."""
        return [self.tokenizer.decode([t]) for t in tokens]

    def completion_logprobs(self, out: _Output) -> dict[str, Any]:
        offsets = [len(self.decode(out.tokens[:i])) for i in range(len(out.tokens))]
        return {"tokens": self.token_texts(out.tokens), "token_logprobs": out.log_probs, "text_offset": offsets,
                "top_logprobs": None}

    def chat_logprobs(self, out: _Output) -> dict[str, Any]:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(self.token_texts(out.tokens), out.log_probs)], "refusal": None}

    async def complete(self, req: CompletionRequest) -> dict[str, Any]:
        self.check_request(req)
        if isinstance(req.prompt, list) and not req.prompt:
            raise APIError(400, "prompt: expected at least one prompt, got an empty list", param="prompt")
        self.check_rows(req, self.prompt_count(req))
        prompts = await self.off_loop(self.completion_prompts, req)
        sampling = self.sampling(req, prompts, req.max_tokens, max_tokens_param="max_tokens", prompt_param="prompt")
        n = req.n or 1
        rows = await self.generate([p for p in prompts for _ in range(n)], sampling, req.seed)
        outs = [self.finish(t, lp, _stops(req)) for t, lp in zip(rows.tokens, rows.log_probs)]
        choices = [{"index": i, "text": o.text, "finish_reason": o.finish_reason,
                    "logprobs": self.completion_logprobs(o) if req.logprobs is not None else None}
                   for i, o in enumerate(outs)]
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.name, "choices": choices, "usage": _usage(prompts, outs)}

    async def chat(self, req: ChatRequest) -> dict[str, Any]:
        self.check_request(req)
        self.check_rows(req, 1)
        prompt = await self.off_loop(self.chat_prompt, req)
        max_tokens, param = ((req.max_completion_tokens, "max_completion_tokens")
                             if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens"))
        sampling = self.sampling(req, [prompt], max_tokens, max_tokens_param=param, prompt_param="messages")
        rows = await self.generate([prompt] * (req.n or 1), sampling, req.seed)
        outs = [self.finish(t, lp, _stops(req)) for t, lp in zip(rows.tokens, rows.log_probs)]
        parse = bool(req.tools) and req.tool_choice != "none"
        choices = []
        for i, o in enumerate(outs):
            message, finish = self.assistant_message(o, parse)
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": self.chat_logprobs(o) if req.logprobs else None})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.name, "choices": choices, "usage": _usage([prompt], outs)}

    def assistant_message(self, out: _Output, parse: bool) -> tuple[dict[str, Any], str]:
        """The choice's message and finish reason: with ``parse``, tool calls in the text become OpenAI
        ``tool_calls`` (all of them readable, or the text stays as it is)."""
        if parse:
            turn = self.parser.parse(out.text)
            if turn.calls and not any(c.error for c in turn.calls):
                calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                         for c in turn.calls]
                return ({"role": "assistant", "content": turn.content or None, "tool_calls": calls},
                        "tool_calls" if out.finish_reason == "stop" else out.finish_reason)
        return {"role": "assistant", "content": out.text}, out.finish_reason

    def model_card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "rlcore",
                "max_model_len": self.context_length}


def _stops(req: SamplingRequest) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def _usage(prompts: list[list[int]], outs: list[_Output]) -> dict[str, int]:
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(o.tokens) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def load_server(model_dir: str | Path, cfg: Config, options: ServeOptions, device: torch.device) -> ModelServer:
    """The model at ``model_dir`` on ``device`` in the rollout engine params ``rollout`` names (the
    ``model`` section's dtype and attention), and its tokenizer."""
    from rlcore.engine.model import ModelSpec, load_rollout_model, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    m = cfg.model
    model = load_rollout_model(ModelSpec(path=str(model_dir), dtype=m.dtype, attn_implementation=m.attn_implementation,
                                         packed_forward=m.packed_forward), device)
    engine = make_engine(model, engine_spec(cfg.rollout),
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return ModelServer(tokenizer, engine, device=device, context_length=model.config.max_position_embeddings,
                       vocab_size=model.config.vocab_size, default_max_tokens=cfg.task.max_response_length,
                       options=options, seed=cfg.seed, tool_parser=cfg.rollout.agent.parser)
