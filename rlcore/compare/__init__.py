"""Compare recipes over seeds: a grid of params values, each cell one DVC experiment, one report.

``rlcore compare --grid algorithm.adv_estimator=grpo,rloo --grid seed=1,2,3`` (``rlcore.commands.compare``)
runs every combination of the grid's values (with ``--set`` overrides fixed for all) as ``dvc exp run -n <cell>
-S key=value ...`` in the repository, one after the other. The stages a cell does not change (data, SFT and
scoring, for a grid over RL keys) are not run again: DVC finds them up to date, or restores them from its run
cache when an earlier cell ran them with the same params (another seed's). Each cell starts from the committed
baseline (tracked files restored), so a failed cell leaves nothing behind; it is reported (which cell, the last
lines of its output, the log file) and the next one runs. A cell already run as an experiment of the same
baseline is read back, not run again (a comparison stopped half way goes on where it stopped; ``rerun`` runs it
again). ``dvc exp show`` lists the cells' experiments under their names.

Each cell's results come from its experiment commit (``git show <rev>:<path>``, the paths from ``dvc.yaml``):
the evaluate stage's metrics (held-out greedy pass@1 gain, sampled pass@k) and per-problem results (where the run
wrote them), the final round's metrics (the mean reward of its last 10 steps) and every round's plot CSV (seconds
per step, the held-out greedy pass@1 curve). The report (:mod:`rlcore.compare.publish`) groups the cells by the
values of the grid's other keys and gives, per group, the mean over its seeds with a confidence interval, and each
group's gain against a baseline group's, paired by seed: a t test over the seeds with Holm's correction for the
number of groups, and the seeds a difference of that size would need (:mod:`rlcore.compare.stats`); a PNG of the
held-out accuracy over RL steps (the mean over seeds with a band of one standard deviation), a markdown page, and
the raw numbers as JSON. It is logged to MLflow as a run of its own (tag ``rlcore.stage`` = ``compare``) and the
page, the PNG and the JSON are copied to ``docs/results/``; ``--from-results`` writes the report again from the
JSON, running nothing.
"""
