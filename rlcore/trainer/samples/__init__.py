"""Samples on worker groups, as the scoring, evaluation, self-play and PPO rounds share them: generating them
(``generation``), the reward model's group (``reward_model``) and their rewards (``scoring``). Nothing here trains."""
