"""The OpenAI-compatible HTTP API over one rollout engine (FastAPI), and loading the model for it.

Endpoints:

* ``GET /health``: ``{"status": "ok", ...}`` plus the scheduler's counters (requests, engine calls,
  rows, engine errors, seconds in the engine);
* ``GET /v1/models`` and ``GET /v1/models/{id}``: the one model served;
* ``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a list of
  such lists; ``logprobs`` (0-5) returns the sampled tokens' log-probs in the legacy format
  (``tokens``, ``token_logprobs``, ``text_offset`` within the completion text; ``top_logprobs`` is null:
  the engines report no alternatives);
* ``POST /v1/chat/completions``: ``messages`` through the tokenizer's chat template with the generation
  prompt; ``logprobs: true`` returns ``choices[i].logprobs.content`` (``top_logprobs`` empty). ``tools`` (OpenAI
  function definitions) go to the chat template; a completion whose text holds tool calls in the format of params
  ``rollout.agent.parser`` (hermes: ``<tool_call>{json}</tool_call>``) comes back as ``message.tool_calls`` (the
  text outside them as ``content``, null when empty) with finish_reason ``"tool_calls"``; a call that cannot be
  read leaves the text as it is, as vLLM does. ``tool_choice`` may be ``"auto"`` or ``"none"`` (no parsing).
  Earlier turns may carry ``tool_calls`` (assistant) and ``tool_call_id`` (tool messages); for a chat template
  that does not render ``tool_calls`` itself (the built-in tiny model's), they are written into the assistant's
  text in the parser's format, as the model wrote them. The server never runs a tool: the client does.

Both take ``model`` (optional: the served name, default the ``--model`` argument as given), ``n``,
``temperature`` (0 = greedy), ``top_p``, ``top_k`` (not OpenAI; as in vLLM, 0 or -1 = off), ``max_tokens``
(chat: also ``max_completion_tokens``; default params ``task.max_response_length``, capped by what the
model's context leaves after the prompt), ``stop`` (a string or a list of at most 16: the text is cut before
the first stop string that the generation completes, finish_reason ``"stop"``) and ``seed`` (reproducible:
see :mod:`rlcore.serve.batcher`). ``finish_reason`` is ``"stop"`` at EOS or a stop string, ``"length"``
at ``max_tokens``; ``usage.completion_tokens`` counts the tokens generated up to that point, EOS
included. The text never includes EOS or other special tokens.

Fields that would change the output and are not implemented (``stream``, ``echo``, ``best_of``,
``suffix``, ``logit_bias``, presence and frequency penalties, a ``tool_choice`` other than auto or none, a
``response_format`` other than text) are refused with a 400 rather than ignored; other unknown fields (``user``,
...) are ignored.

**Limits** (the ``rlcore serve`` options, :class:`ServeOptions`), as vLLM's OpenAI server sets them where it has
one:

* a request body over ``--max-body-bytes`` is refused with 413 before it is read (by its Content-Length, or
  as it arrives when it has none); more completions than ``--max-batch-size`` rows (prompts x ``n``) or
  ``n`` over ``--max-n`` are refused with 400 before any prompt is tokenized; prompts are tokenized and
  chat templates rendered off the event loop, in one thread of their own;
* ``max_tokens`` is capped at ``--max-tokens`` (vLLM's server-wide ``max_tokens``: a request asking for more
  gets that many, finish_reason ``"length"``) after the prompt plus the request's own ``max_tokens`` is checked
  against the context, so no request preallocates more than prompt + ``--max-tokens`` positions per row;
* at most ``--max-queue`` requests wait for the engine; one more gets 503 with a ``Retry-After`` header
  (seconds, from the engine's pace so far), so the queue and the memory it holds stay bounded;
* a request not answered within ``--request-timeout`` seconds gets 504; it leaves the queue (or, when its
  engine call already runs, its rows are dropped when the call ends);
* sampling settings cannot make NaN: NaN and infinities are refused (400); as in vLLM, a temperature under
  1e-5 is greedy and one in [1e-5, 1e-2) is raised to 1e-2 (``logits / temperature`` overflows near 0).

Every error has OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``: malformed JSON and
invalid fields (FastAPI's 422) are 400 ``invalid_request_error``, an unknown model 404
``model_not_found``, a prompt plus ``max_tokens`` over the context 400 ``context_length_exceeded``, a full
queue 503 ``server_busy``, a timeout 504 ``timeout``, a body too large 413 ``request_too_large``. An engine
failure or any other exception is a 500 ``server_error`` that names an error id and nothing of the server's
internals; the traceback goes to the server's log under that id (the request fails; the server goes on).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlcore.agents.parsers import PARSERS, ToolCall
from rlcore.config import Config
from rlcore.rollout import RolloutEngine
from rlcore.serve.batcher import Batcher, Busy, Rows, Sampling

log = logging.getLogger("rlcore.serve")


# ---------------------------------------------------------------------------------------------- requests

# As vLLM: temperatures under GREEDY_BELOW are greedy, those under MIN_TEMPERATURE are raised to it (dividing the
# logits by a temperature near 0 overflows to inf, and the softmax of inf is NaN).
GREEDY_BELOW = 1e-5
MIN_TEMPERATURE = 1e-2
MAX_STOP_STRINGS = 16


class _Body(BaseModel):
    # strict: "2" is not an int, true is not a number; NaN and infinities (Python's json accepts them) are refused;
    # unknown fields are kept for _refuse_unsupported
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class _SamplingRequest(_Body):
    model: str | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # not OpenAI; as in vLLM: 0 or -1 = off
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    """A JSON object, as text (OpenAI's format)."""


class ToolCallItem(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, Field(validate_default=True)] = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_present(cls, value: Any, info: ValidationInfo) -> Any:
        """Only an assistant's message may leave out its content (OpenAI: one that carries tool calls)."""
        role = info.data.get("role")  # absent when the role itself failed: that error is the one reported
        if value is None and role not in ("assistant", None):
            raise ValueError(f"a {role} message needs content (text or text parts)")
        return value


class FunctionDefinition(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ChatRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None


# field -> the values that leave the output as this server makes it
UNSUPPORTED = {"stream": (None, False), "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
               "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "response_format": (None, {"type": "text"})}
FIELD_NAMES = {name for m in (CompletionRequest, ChatRequest, ChatMessage, TextPart, ToolCallItem, FunctionCall,
                              ToolDefinition, FunctionDefinition) for name in m.model_fields}


# ------------------------------------------------------------------------------------------------ errors

class APIError(Exception):
    """An error answered with OpenAI's error body (and ``headers``, e.g. ``Retry-After``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}}, status_code=status,
                        headers=headers)


def error_bytes(status: int, message: str, code: str) -> bytes:
    """The body of :func:`error_response` as bytes, for an answer sent below FastAPI (:class:`BodyLimit`)."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": code}}).body


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 before the app reads it, by its
    Content-Length (a body of up to :attr:`drain_bytes` more is read and dropped first; a larger one is not waited
    for), or (chunked, no length) as soon as the bytes received pass the limit; so no request holds
    more than ``max_bytes`` of body in memory. A body still arriving after ``timeout_s`` is answered 408. The body
    read is handed on to the app unchanged."""

    drain_bytes = 1 << 20
    """Bytes of an oversized body read and dropped before the 413, so the client reads the answer (beyond: closed)."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            what = f"{int(length)} bytes" if length.isdigit() else f"Content-Length {length[:20]!r}"
            if length.isdigit() and int(length) <= self.max_bytes + self.drain_bytes:
                # a body the client may already be sending (the official clients send it with the headers): read
                # and dropped first, else the close resets the connection before the client reads the 413
                try:
                    if await asyncio.wait_for(self._read(receive), self.timeout_s) is None:
                        return  # the client went away
                except TimeoutError:
                    pass
            return await self._refuse(send, 413, f"The request body is too large: {what}; this server takes at most "
                                                 f"{self.max_bytes} (--max-body-bytes)", "request_too_large")
        try:
            read = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except TimeoutError:
            return await self._refuse(send, 408, f"The request body did not arrive within --request-timeout "
                                                 f"{self.timeout_s:g} s", "timeout")
        if read is None:  # the client went away
            return
        body, size = read
        if size > self.max_bytes:
            return await self._refuse(send, 413, f"The request body is too large: more than {self.max_bytes} bytes, "
                                                 "the most this server takes (--max-body-bytes)", "request_too_large")
        handed = False

        async def replay():
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive) -> tuple[bytes, int] | None:
        """The body and its size in bytes, keeping no more than ``max_bytes`` of it (a longer one: the rest is read
        and dropped, up to :attr:`drain_bytes`, and the bytes kept are not the body); None if the client left.

        The rest of an oversized body is drained before the 413 rather than left unread: a socket closed with
        unread bytes is reset (RST), and the client, still sending, would see "connection reset" instead of the
        answer (the lingering close of nginx, Go's net/http)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            size += len(message.get("body", b""))
            if size <= self.max_bytes:
                chunks.append(message.get("body", b""))
            if not message.get("more_body", False) or size > self.max_bytes + self.drain_bytes:
                return b"".join(chunks), size

    @staticmethod
    async def _refuse(send, status: int, message: str, code: str) -> None:
        body = error_bytes(status, message, code)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def validation_error(err: RequestValidationError) -> tuple[str, str | None]:
    """One line and the field's dotted name for FastAPI's validation errors. A field declared as a union
    fails once per member (loc ends with the member's type, e.g. ``prompt.list[str]``): those become one
    "expected one of" line."""
    errors = err.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return "The request body is not valid JSON" + (f" ({detail})" if detail else ""), None

    def path(e: dict) -> tuple[list[str], list[str]]:
        names: list[str] = []
        tags: list[str] = []
        for part in tuple(e["loc"])[1:] if tuple(e["loc"])[:1] == ("body",) else e["loc"]:
            if not tags and (isinstance(part, int) or part in FIELD_NAMES):
                names.append(str(part))
            else:
                tags.append(str(part))
        return names, tags

    if tuple(first["loc"]) == ("body",) and isinstance(first.get("input"), bytes):  # not parsed: not sent as JSON
        return "The request body must be a JSON object sent with the header Content-Type: application/json", None
    names, tags = path(first)
    param = ".".join(names) or None
    where = param or "request body"
    got = first.get("input")
    shown = f" (got {got!r})" if got is not None and len(repr(got)) <= 60 and first["type"] != "missing" else ""
    same = [e for e in errors if path(e)[0] == names]
    if len(same) > 1 and all(path(e)[1] for e in same):
        members = list(dict.fromkeys(path(e)[1][0] for e in same))
        return f"{where}: expected one of {', '.join(members)}{shown}", param
    return f"{where}: {first['msg']}{shown}", param


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

    def check_request(self, req: _SamplingRequest) -> None:
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

    def check_rows(self, req: _SamplingRequest, prompts: int) -> None:
        """``prompts`` x ``n`` completions fit one engine call: checked before any prompt is tokenized."""
        n = req.n or 1
        if n * prompts > self.options.max_batch_size:
            raise APIError(400, f"n: {prompts} prompt(s) x n={n} = {n * prompts} completions; this server "
                                f"generates at most {self.options.max_batch_size} per request (--max-batch-size)",
                           param="n")

    def sampling(self, req: _SamplingRequest, prompts: list[list[int]], max_tokens: int | None, *,
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

    def temperature(self, req: _SamplingRequest) -> float:
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


def _stops(req: _SamplingRequest) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def _usage(prompts: list[list[int]], outs: list[_Output]) -> dict[str, int]:
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(o.tokens) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def load_server(model_dir: str | Path, cfg: Config, options: ServeOptions, device: torch.device) -> ModelServer:
    """The model at ``model_dir`` on ``device`` in the rollout engine params ``rollout`` names (the
    ``model`` section's dtype and attention), and its tokenizer."""
    from rlcore.engine.model import ModelSpec, load_rollout_model, load_tokenizer
    from rlcore.rollout import engine_spec, make_engine

    tokenizer = load_tokenizer(model_dir)
    m = cfg.model
    model = load_rollout_model(ModelSpec(path=str(model_dir), dtype=m.dtype, attn_implementation=m.attn_implementation,
                                         packed_forward=m.packed_forward), device)
    engine = make_engine(model, engine_spec(cfg.rollout),
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return ModelServer(tokenizer, engine, device=device, context_length=model.config.max_position_embeddings,
                       vocab_size=model.config.vocab_size, default_max_tokens=cfg.task.max_response_length,
                       options=options, seed=cfg.seed, tool_parser=cfg.rollout.agent.parser)


# --------------------------------------------------------------------------------------------------- app

def create_app(server: ModelServer) -> FastAPI:
    """The FastAPI app over ``server``; its scheduler starts and stops with the app (lifespan)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.batcher.start()
        try:
            yield
        finally:
            await server.batcher.stop()
            server.tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="rlcore serve", description="OpenAI-compatible completions over an rlcore rollout engine",
                  lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=server.options.max_body_bytes, timeout_s=server.options.request_timeout_s)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, type=err.type, param=err.param, code=err.code,
                              headers=err.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception) -> JSONResponse:  # anything else: no internals to the client
        api = server.internal_error(f"{request.method} {request.url.path} failed", err)
        return error_response(api.status, api.message, type=api.type)

    async def answered(work) -> dict[str, Any]:
        """``await work`` within ``--request-timeout``; past it, 504 (the batcher drops the job)."""
        timeout = server.options.request_timeout_s
        try:
            return await asyncio.wait_for(work, timeout)
        except TimeoutError:
            server.counters["timeouts"] += 1
            raise APIError(504, f"The request was not answered within --request-timeout {timeout:g} s; retry later "
                                "or ask for fewer tokens", type="server_error", code="timeout") from None

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_error(err)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, f"{request.method} {request.url.path}: {err.detail}")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.name, "batching": server.options.batching,
                "waiting": server.batcher.waiting, **server.batcher.stats, **server.counters}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != server.name:
            raise APIError(404, f"The model '{model_id}' does not exist; this server serves '{server.name}'",
                           param="model", code="model_not_found")
        return server.model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await answered(server.complete(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        return await answered(server.chat(req))

    return app
