"""The PPO round's parts: a round (``runner.RoundRunner``) is a batch source and a PPO step (``ppo_step.PPOStep``)
over the round's worker groups (``worker_groups``). ``ppo.mode`` picks the source (``modes.ROUND_MODES``): ``sync``'s
is the trainer's own ranks (``sync_source``), ``async``'s the generators' queue (``async_source``); either scores its
batches the same way (``scoring``) and draws prompts from one sampler (``prompt_sampler``) with the seeds of
``seeds``. ``validation`` is the held-out check during a round, ``kept_samples`` the samples it keeps for
inspection."""
