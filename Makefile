# Two commands a user needs: `make run` (the whole pipeline) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench bench-serve bench-async bench-reward bench-agent compare-estimators compare-losses setup mlflow-ui clean

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

# the tool loop on the static engine: a multi-turn rollout against a single-turn one of the same total tokens
# (docs/results/agents.md)
bench-agent: $(STAMP)
	$(PY) -m bench.agent_cost --rows 256
	$(PY) -m bench.agent_cost --rows 64 --hidden 256 --layers 4

# Every advantage estimator, and every policy loss under GRPO, over seeds 1-3 with the default recipe: DVC
# experiments and a report each (compare/<name>/, docs/results/compare-<name>.md; rlcore compare --help). Hours on
# 2 cores; a run stopped half way goes on where it stopped. Needs a clean commit.
SEEDS ?= 1,2,3
compare-estimators: $(STAMP)
	$(VENV)/bin/rlcore compare --name estimators --grid seed=$(SEEDS) --grid algorithm.adv_estimator=$$($(PY) -c \
		"from rlcore.names import ADV_ESTIMATORS as n; print(','.join(n))")

compare-losses: $(STAMP)
	$(VENV)/bin/rlcore compare --name policy-losses --grid seed=$(SEEDS) --set algorithm.adv_estimator=grpo \
		--grid actor.policy_loss=$$($(PY) -c "from rlcore.names import POLICY_LOSSES as n; print(','.join(n))")

mlflow-ui: $(STAMP)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --port 5000

clean:
	rm -rf data/processed data/scored models metrics plots mlflow.db
