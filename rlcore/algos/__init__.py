"""RL algorithm math: advantage estimators (``advantage``), policy losses (``losses``), the value loss
(``value_loss``), KL estimators (``kl``), loss aggregation (``aggregation``), KL control (``kl_control``),
off-policy weights (``off_policy``), masked reductions (``masked``), entropy (``entropy``).

Pure tensor functions (torch/numpy only, no I/O, no config objects). Names that a config selects
are looked up in the registries ``advantage.ESTIMATORS``, ``losses.POLICY_LOSSES``,
``kl.KL_ESTIMATORS``, ``aggregation.LOSS_AGG_MODES`` and ``kl_control.KL_CONTROLLERS``; each entry
declares what it needs. This package file imports nothing, so a stage that uses one module
(``entropy`` for SFT metrics) does not load, and depend on, the others.
"""
