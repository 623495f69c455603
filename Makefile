# sdflow: every command a developer or CI runs. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --disable-pip-version-check -q
CONSTRAINTS := -c requirements/constraints.txt
STAMP := $(VENV)/.installed
TOOLS_STAMP := .tools/.installed

.PHONY: help setup test test-unit test-image test-fast demo lint format bench schema clean

help:  ## list the commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml training_image/requirements.txt training_image/requirements-colossalai.txt layers/common/requirements.txt requirements/dev.txt requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) $(CONSTRAINTS) -r training_image/requirements.txt -r layers/common/requirements.txt -r requirements/dev.txt
	# colossalai's metadata pins torch<=2.5.1 and diffusers==0.29: it goes on top without deps.
	$(PIP) --no-deps $(CONSTRAINTS) -r training_image/requirements-colossalai.txt
	# the `sdflow` command (CLI + local runtime), editable so it runs this checkout's code
	$(PIP) --no-deps -e .
	touch $@

# The SAM CLI and checkov each get a venv of their own, as their docs advise: in one venv
# with the rest, pip backtracks through every uvicorn release.
$(TOOLS_STAMP): requirements/tools-sam.txt requirements/tools-checkov.txt
	$(PYTHON) -m venv .tools/sam && .tools/sam/bin/pip install --disable-pip-version-check -q -r requirements/tools-sam.txt
	$(PYTHON) -m venv .tools/checkov && .tools/checkov/bin/pip install --disable-pip-version-check -q -r requirements/tools-checkov.txt
	touch $@

setup: $(STAMP) $(TOOLS_STAMP)  ## create .venv and the tool venvs with the pinned requirements

test: setup  ## the whole suite: unit, image and e2e tests, lint checks included (what CI runs)
	$(BIN)/pytest

test-unit: setup  ## unit tests only (seconds)
	$(BIN)/pytest tests/unit -m "not slow"

test-image: setup  ## the training_image code on CPU
	$(BIN)/pytest tests/image

demo: setup  ## the whole pipeline on this machine (local runtime), ending with a generated image
	$(BIN)/sdflow demo

lint: setup  ## ruff, mypy, cfn-lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy layers/common/sdflow_common training_image/sdflow_image sdflow
	$(BIN)/cfn-lint template.yaml

format: setup  ## ruff format + autofix
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup  ## benchmarks: ratios measured side by side in one run
	$(BIN)/python bench/bench_train.py
	$(BIN)/python bench/bench_download.py
	$(BIN)/python bench/bench_local_runtime.py

schema: setup  ## regenerate schemas/run-document.schema.json from the pydantic model
	PYTHONPATH=layers/common $(BIN)/python -m sdflow_common.run_document > schemas/run-document.schema.json

clean:  ## remove venvs, build output and caches
	rm -rf $(VENV) .tools .aws-sam scratch .pytest_cache .mypy_cache .ruff_cache
