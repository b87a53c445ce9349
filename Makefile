# Two commands a user needs: `make run` (the whole pipeline) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench bench-serve bench-async bench-reward setup mlflow-ui clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

# dvc needs a git repository; a fresh export without one gets a local one.
run: $(STAMP)
	@git rev-parse --git-dir >/dev/null 2>&1 || git init -q
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" dvc repro

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench,test]"
	$(PY) -m bench.run_bench --configs default,realistic

# rlcore serve under load (64 clients, batching vs --no-batching): its own section of bench/RESULTS.md
bench-serve: $(STAMP)
	$(PY) -m bench.serve_load

# sync vs async rounds on the same CPUs (default and long-tailed workloads), the weight hand-off (object store vs
# gloo), and the discrete-event simulation at 8-64 GPUs: the "async" section of bench/RESULTS.md
bench-async: $(STAMP)
	$(PY) -m bench.async_bench

# what the reward functions cost in a PPO step (rule alone, two user functions, a slow one: processes, async):
# its own section of bench/RESULTS.md
bench-reward: $(STAMP)
	$(PY) -m bench.reward_cost

mlflow-ui: $(STAMP)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --port 5000

clean:
	rm -rf data/processed data/scored models metrics plots mlflow.db
