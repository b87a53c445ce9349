"""The loop infrastructure every training stage runs in: the job frame on Ray (``job``: the resource pool of
``pool``, the worker groups, resume, saving the model, shutting down), what its worker groups load (``model_specs``),
the step loop (``steps``) with its step checkpoints (``checkpoint``) and its step log (``step_log``). Nothing here
knows an algorithm or a stage."""
