"""The stage drivers: one module per stage that trains, scores or evaluates (``prepare``, ``sft``, ``rm``, ``score``,
``ppo``, ``evaluate``) and ``rlcore generate``'s, each called by its stage script (``stages/``) or command.

What they are built from lives in the folders below, by kind: ``round/`` the PPO round's parts (a batch source and
a PPO step over the round's worker groups), ``samples/`` generating and scoring samples on worker groups, ``loop/``
the loop infrastructure every training stage runs in. Imports go one way, drivers -> round -> samples -> loop
(tests/test_import_graph.py holds it).
"""
