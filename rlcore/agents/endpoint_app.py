"""The agent endpoint's HTTP routes, over an :class:`~rlcore.agents.endpoint.AgentEndpoint`: OpenAI's chat
completions and models under each trajectory's base URL, ``/t/<token>/v1``, with rlcore serve's body limit and error
bodies (:func:`rlcore.serve.app.add_error_handlers`). A body that does not validate fails its trajectory
(``bad_request``), as any other refused request does.

The chat route, thousands of requests a step, is answered below FastAPI (:class:`ChatRoute`, the app uvicorn
serves): the body limit, then the body validated by pydantic from its JSON bytes and the answer written with
``json.dumps``, the error bodies those of the FastAPI app. Starlette's middleware, routing and exception layers and
FastAPI's dependency solving were a third of the endpoint's time per request once the model is fast. Every other
route and the lifespan go to the FastAPI app."""

from __future__ import annotations

import json
import re

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from rlcore.agents.endpoint import MODEL_NAME, AgentEndpoint
from rlcore.agents.recording import BAD_REQUEST
from rlcore.serve.app import add_error_handlers, scheduler_lifespan
from rlcore.serve.http import APIError, BodyLimit, error_response
from rlcore.serve.schema import ChatRequest, validation_error

CHAT_PATH = re.compile(r"/t/([^/]+)/v1/chat/completions")


def agent_app(endpoint: AgentEndpoint) -> ChatRoute:
    """The app; the endpoint's batcher starts and stops with it."""
    app = FastAPI(title="rlcore agent endpoint", lifespan=scheduler_lifespan(endpoint))
    add_error_handlers(app, endpoint)

    @app.get("/t/{token}/v1/models")
    async def models(token: str):
        endpoint.record_of(token)
        return {"object": "list", "data": [endpoint.model_card()]}

    @app.get("/t/{token}/v1/models/{model_id:path}")
    async def model(token: str, model_id: str):
        endpoint.record_of(token)
        return {**endpoint.model_card(), "id": model_id or MODEL_NAME}

    return ChatRoute(app, endpoint)


class ChatRoute:
    """ASGI: ``POST /t/<token>/v1/chat/completions`` answered here (module docstring), anything else by ``app``."""

    def __init__(self, app: FastAPI, endpoint: AgentEndpoint):
        self.app, self.endpoint = app, endpoint
        self.limited = BodyLimit(self._chat, max_bytes=endpoint.options.max_body_bytes,
                                 timeout_s=endpoint.options.request_timeout_s)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and CHAT_PATH.fullmatch(scope["path"]):
            return await self.limited(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _chat(self, scope, receive, send) -> None:
        token = CHAT_PATH.fullmatch(scope["path"]).group(1)
        body = (await receive()).get("body", b"")  # the whole body, read by the body limit
        try:
            answer = await self._answer(token, body)
        except APIError as err:
            response = error_response(err.status, err.message, type=err.type, param=err.param, code=err.code,
                                      headers=err.headers)
        except Exception as err:  # noqa: BLE001 - a bug: no internals to the client, logged with its traceback
            api = self.endpoint.internal_error(f"POST {scope['path']} failed", err)
            response = error_response(api.status, api.message, type=api.type)
        else:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(answer)).encode())]})
            return await send({"type": "http.response.body", "body": answer})
        await response(scope, receive, send)

    async def _answer(self, token: str, body: bytes) -> bytes:
        try:
            req = ChatRequest.model_validate_json(body)
        except ValidationError as err:
            message, param = validation_error(RequestValidationError(err.errors()))
            if token in self.endpoint.records:
                self.endpoint.records[token].fail(BAD_REQUEST, message)
            raise APIError(400, message, param=param) from None
        return json.dumps(await self.endpoint.agent_chat(token, req), ensure_ascii=False).encode()
