"""``rlcore serve``: an OpenAI-compatible HTTP server over one rollout engine.

* :mod:`rlcore.serve.app`: the FastAPI app and its routes (``/health``, ``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions``); the API's description;
* :mod:`rlcore.serve.schema`: the request models, and one line naming the field of a request that does not
  validate;
* :mod:`rlcore.serve.http`: OpenAI-style error bodies and the request-body limit (ASGI middleware);
* :mod:`rlcore.serve.server`: the model behind the routes (:class:`~rlcore.serve.server.ModelServer`: requests
  in, response bodies out) and its loading into a :class:`~rlcore.rollout.RolloutEngine`;
* :mod:`rlcore.serve.batcher`: the scheduler that batches concurrent requests onto that engine.

The model runs in the server process itself (CPU, or CUDA when there is one): one process, one
engine, no Ray. The command (``rlcore/commands/serve.py``) only parses options and starts uvicorn.
"""
