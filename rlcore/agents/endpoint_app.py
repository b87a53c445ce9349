"""The agent endpoint's HTTP routes (FastAPI), over an :class:`~rlcore.agents.endpoint.AgentEndpoint`: OpenAI's chat
completions and models under each trajectory's base URL, ``/t/<token>/v1``, with rlcore serve's body limit and error
bodies (:func:`rlcore.serve.app.add_error_handlers`). A body that does not validate fails its trajectory
(``bad_request``) as any other refused request does."""

from __future__ import annotations

import re
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rlcore.agents.endpoint import MODEL_NAME, AgentEndpoint
from rlcore.agents.recording import BAD_REQUEST
from rlcore.serve.app import add_error_handlers
from rlcore.serve.http import error_response
from rlcore.serve.schema import ChatRequest, validation_error

_TOKEN = re.compile(r"^/t/([0-9a-f]+)/")


def agent_app(endpoint: AgentEndpoint) -> FastAPI:
    """The app; the endpoint's batcher starts and stops with it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await endpoint.batcher.start()
        try:
            yield
        finally:
            await endpoint.batcher.stop()
            endpoint.tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="rlcore agent endpoint", lifespan=lifespan)
    add_error_handlers(app, endpoint)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        message, param = validation_error(err)
        found = _TOKEN.match(request.url.path)
        if found and found.group(1) in endpoint.records:
            endpoint.records[found.group(1)].fail(BAD_REQUEST, message)
        return error_response(400, message, param=param)

    @app.post("/t/{token}/v1/chat/completions")
    async def chat_completions(token: str, req: ChatRequest):
        return await endpoint.agent_chat(token, req)

    @app.get("/t/{token}/v1/models")
    async def models(token: str):
        endpoint.record_of(token)
        return {"object": "list", "data": [endpoint.model_card()]}

    @app.get("/t/{token}/v1/models/{model_id:path}")
    async def model(token: str, model_id: str):
        endpoint.record_of(token)
        return {**endpoint.model_card(), "id": model_id or MODEL_NAME}

    return app
