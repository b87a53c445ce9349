"""Benchmark of rlcore against TRL's GRPOTrainer on this machine (not part of `make test`).

    make bench                                   # or: .venv/bin/python -m bench.run_bench

run_bench (entry point) drives two child processes, ours.py (rlcore) and trl_side.py (TRL),
over wire.py; settings.py holds the shared knobs, prepare.py the data and SFT fixture,
monitor.py/machine.py/profile.py the measurements, report.py/text.py the markdown.
ab.py measures config changes on our side alone, paired (the method behind EXPERIMENTS.md).
"""
