"""The OpenAI-compatible HTTP API over one rollout engine (FastAPI): its routes, and what it answers.

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

**Limits** (the ``rlcore serve`` options, :class:`~rlcore.serve.server.ServeOptions`), as vLLM's OpenAI server sets
them where it has one:

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
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlcore.serve.http import APIError, BodyLimit, error_response
from rlcore.serve.schema import ChatRequest, CompletionRequest, validation_error
from rlcore.serve.server import ModelServer


# --------------------------------------------------------------------------------------------------- app

def add_error_handlers(app: FastAPI, server: ModelServer) -> None:
    """The body limit and OpenAI's error bodies (module docstring) on ``app``, over ``server``."""
    app.add_middleware(BodyLimit, max_bytes=server.options.max_body_bytes, timeout_s=server.options.request_timeout_s)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, type=err.type, param=err.param, code=err.code,
                              headers=err.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, err: Exception) -> JSONResponse:  # anything else: no internals to the client
        api = server.internal_error(f"{request.method} {request.url.path} failed", err)
        return error_response(api.status, api.message, type=api.type)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_error(err)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(err.status_code, f"{request.method} {request.url.path}: {err.detail}")


def scheduler_lifespan(server: ModelServer):
    """An app's lifespan over ``server`` (or the agent endpoint: anything with its ``batcher`` and ``tokenizing``
    pool): the scheduler starts with the app, and stops, with the tokenizing threads let go, when it ends."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.batcher.start()
        try:
            yield
        finally:
            await server.batcher.stop()
            server.tokenizing.shutdown(wait=False, cancel_futures=True)

    return lifespan


def create_app(server: ModelServer) -> FastAPI:
    """The FastAPI app over ``server``; its scheduler starts and stops with the app (lifespan)."""
    app = FastAPI(title="rlcore serve", description="OpenAI-compatible completions over an rlcore rollout engine",
                  lifespan=scheduler_lifespan(server))
    app.state.server = server
    add_error_handlers(app, server)

    async def answered(work) -> dict[str, Any]:
        """``await work`` within ``--request-timeout``; past it, 504 (the batcher drops the job)."""
        timeout = server.options.request_timeout_s
        try:
            return await asyncio.wait_for(work, timeout)
        except TimeoutError:
            server.counters["timeouts"] += 1
            raise APIError(504, f"The request was not answered within --request-timeout {timeout:g} s; retry later "
                                "or ask for fewer tokens", type="server_error", code="timeout") from None

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
