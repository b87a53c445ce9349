"""``rlcore serve``: an OpenAI-compatible HTTP server over one rollout engine.

* :mod:`rlcore.serve.app`: the FastAPI app (``/health``, ``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions``), its request models and OpenAI-style errors, and the loading of the model
  into a :class:`~rlcore.rollout.RolloutEngine`;
* :mod:`rlcore.serve.batcher`: the scheduler that batches concurrent requests onto that engine.

The model runs in the server process itself (CPU, or CUDA when there is one): one process, one
engine, no Ray. The command (``rlcore/commands/serve.py``) only parses options and starts uvicorn.
"""
