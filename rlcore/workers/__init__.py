"""Ray actor classes, one rank each of a worker group, and the typed specs their methods take.

* ``rollout.RolloutWorker``: generation only (score and evaluate stages);
* ``sft.SFTWorker``: supervised fine-tuning steps;
* ``actor.ActorRolloutRefWorker``: the PPO policy with its rollout engine and reference;
* ``critic.CriticWorker``: the value model for GAE.

Each is driven as ``group.call(Worker.method, batch, spec)`` (``rlcore.controller.worker_group``).
"""

from rlcore import heap

heap.rank_loading()  # before the worker modules' imports (torch, transformers) in a rank's own process
