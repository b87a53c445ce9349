"""Ray actor classes, one rank each of a worker group, and the typed specs their methods take.

* ``rollout.RolloutWorker``: generation only (score and evaluate stages);
* ``sft.SFTWorker``: supervised fine-tuning steps;
* ``actor.ActorRolloutRefWorker``: the PPO policy with its rollout engine and reference;
* ``critic.CriticWorker``: the value model for GAE.

Each is driven as ``group.call(Worker.method, batch, spec)`` (``rlcore.controller.worker_group``). Importing
this package changes nothing in the process: a rank's process is tuned by Ray's setup hook before it imports
anything of it (``rlcore.heap.rank_loading``, named by ``rlcore.controller.resource_pool.job_runtime_env``).
"""
