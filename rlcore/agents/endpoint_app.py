"""The agent endpoint's HTTP routes, over an :class:`~rlcore.agents.endpoint.AgentEndpoint`: OpenAI's chat
completions and models under each trajectory's base URL, ``/t/<token>/v1``, with rlcore serve's body limit and error
bodies (:func:`rlcore.serve.app.add_error_handlers`). A body that does not validate fails its trajectory
(``bad_request``), as any other refused request does.

The chat route is a plain Starlette route: the body is validated by pydantic from its JSON bytes and the answer
written with ``json.dumps``, without FastAPI's per-request dependency solving and response encoding (most of what a
request cost here once the model is fast: thousands of requests a step)."""

from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from rlcore.agents.endpoint import MODEL_NAME, AgentEndpoint
from rlcore.agents.recording import BAD_REQUEST
from rlcore.serve.app import add_error_handlers, scheduler_lifespan
from rlcore.serve.http import error_response
from rlcore.serve.schema import ChatRequest, validation_error


def agent_app(endpoint: AgentEndpoint) -> FastAPI:
    """The app; the endpoint's batcher starts and stops with it."""
    app = FastAPI(title="rlcore agent endpoint", lifespan=scheduler_lifespan(endpoint))
    add_error_handlers(app, endpoint)

    async def chat_completions(request: Request) -> Response:
        token = request.path_params["token"]
        try:
            req = ChatRequest.model_validate_json(await request.body())
        except ValidationError as err:
            message, param = validation_error(RequestValidationError(err.errors()))
            if token in endpoint.records:
                endpoint.records[token].fail(BAD_REQUEST, message)
            return error_response(400, message, param=param)
        body = await endpoint.agent_chat(token, req)
        return Response(json.dumps(body, ensure_ascii=False).encode(), media_type="application/json")

    app.router.add_route("/t/{token}/v1/chat/completions", chat_completions, methods=["POST"])

    @app.get("/t/{token}/v1/models")
    async def models(token: str):
        endpoint.record_of(token)
        return {"object": "list", "data": [endpoint.model_card()]}

    @app.get("/t/{token}/v1/models/{model_id:path}")
    async def model(token: str, model_id: str):
        endpoint.record_of(token)
        return {**endpoint.model_card(), "id": model_id or MODEL_NAME}

    return app
