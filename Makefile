# sdflow: every command a developer or CI runs. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Every venv is installed by uv (pinned in requirements/tools-uv.txt), from the same pinned
# requirements and constraints files pip would read, so the resolved sets are the same; uv unpacks
# and links wheels in parallel: the job environment's 3 GB stack installs in 45 s instead of pip's
# 2 min 41 s on a cold cache here. The Dockerfiles keep pip (what a builder has); the image replay
# (make image-replay) runs their pip lines as written.
UV_VENV := .tools/uv
UV := $(UV_VENV)/bin/uv
UV_STAMP := $(UV_VENV)/.installed
PIP := $(UV) pip install -q --python $(BIN)/python
CONSTRAINTS := -c requirements/constraints.txt
STAMP := $(VENV)/.installed
IMAGE_VENV := .venv-image
IMAGE_BIN := $(IMAGE_VENV)/bin
IMAGE_STAMP := $(IMAGE_VENV)/.ready
# The second job environment: the accelerate backend's stack (training_image/requirements-accelerate.txt).
ACC_VENV := .venv-accelerate
ACC_BIN := $(ACC_VENV)/bin
ACC_STAMP := $(ACC_VENV)/.ready
TOOLS_STAMP := .tools/.installed
# The notebook environment: the SageMaker Python SDK v3 and sdflow.sdk (docs/notebooks).
SDK_VENV := .venv-sdk
SDK_STAMP := $(SDK_VENV)/.ready
# Debian's Chromium, for the run console's browser tests (tests/e2e/test_console_browser.py):
# Playwright drives it and never downloads a browser of its own.
CHROMIUM := /usr/bin/chromium
GXX := /usr/bin/g++
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: help setup browser console notebook check test test-unit test-image test-accelerate test-fast image-replay image-replay-colossalai image-replay-accelerate demo demo-lora lint format bench schema clean

help:  ## list the commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

# uv itself, the one install pip does.
$(UV_STAMP): requirements/tools-uv.txt
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/pip install --disable-pip-version-check -q -r $<
	touch $@

$(STAMP): pyproject.toml layers/common/requirements.txt requirements/local.txt requirements/dev.txt requirements/constraints.txt | $(UV_STAMP)
	$(PYTHON) -m venv $(VENV)
	$(PIP) $(CONSTRAINTS) -r layers/common/requirements.txt -r requirements/local.txt -r requirements/dev.txt
	# the `sdflow` command (CLI + local runtime), editable so it runs this checkout's code
	$(PIP) --no-deps -e .
	touch $@

# The job environment: the container's Python stack, from the very files the Dockerfile installs
# (Colossal-AI 0.5.0's declared range, dependencies resolved), plus the test tools. The local
# runtime runs download, training and serving jobs with its Python (sdflow/local/sagemaker/job_env.py).
$(IMAGE_STAMP): training_image/requirements.txt training_image/requirements-colossalai.txt training_image/constraints.txt requirements/image-test.txt | $(UV_STAMP)
	$(PYTHON) -m venv $(IMAGE_VENV)
	$(UV) pip install -q --python $(IMAGE_BIN)/python -c training_image/constraints.txt \
		-r training_image/requirements.txt -r training_image/requirements-colossalai.txt -r requirements/image-test.txt
	$(UV) pip check --python $(IMAGE_BIN)/python
	touch $@

# The second job environment, for the accelerate backend's jobs (SD 3.5, FLUX.2 [klein], Qwen-Image):
# the very file Dockerfile.accelerate installs (the newest torch, diffusers, transformers, accelerate
# and peft that resolve together; no Colossal-AI, no img2dataset), plus the test tools. The local
# runtime runs that backend's jobs with its Python (sdflow/local/sagemaker/job_env.py).
$(ACC_STAMP): training_image/requirements-accelerate.txt training_image/constraints-accelerate.txt requirements/image-test.txt | $(UV_STAMP)
	$(PYTHON) -m venv $(ACC_VENV)
	$(UV) pip install -q --python $(ACC_BIN)/python -c training_image/constraints-accelerate.txt \
		-r training_image/requirements-accelerate.txt -r requirements/image-test.txt
	$(UV) pip check --python $(ACC_BIN)/python
	touch $@

# Its own venv: the SDK's resolved set (mlflow among it) caps pyarrow and rich below .venv's pins.
$(SDK_STAMP): requirements/sdk.txt requirements/sdk-constraints.txt pyproject.toml | $(UV_STAMP)
	$(PYTHON) -m venv $(SDK_VENV)
	$(UV) pip install -q --python $(SDK_VENV)/bin/python -c requirements/sdk-constraints.txt -r requirements/sdk.txt
	$(UV) pip install -q --python $(SDK_VENV)/bin/python --no-deps -e .
	$(UV) pip check --python $(SDK_VENV)/bin/python
	touch $@

# The SAM CLI and checkov each get a venv of their own, as their docs advise: in one venv
# with the rest, pip backtracks through every uvicorn release.
$(TOOLS_STAMP): .tools/sam/.installed .tools/checkov/.installed
	touch $@

.tools/%/.installed: requirements/tools-%.txt | $(UV_STAMP)
	$(PYTHON) -m venv .tools/$*
	$(UV) pip install -q --python .tools/$*/bin/python -r $<
	touch $@

setup:  ## create .venv (orchestration), .venv-image and .venv-accelerate (jobs), .venv-sdk (notebooks) and the tool venvs, pinned
	# The six venvs are independent and mostly wait on downloads: built side by side.
	$(MAKE) --no-print-directory -j6 $(STAMP) $(IMAGE_STAMP) $(ACC_STAMP) $(SDK_STAMP) $(TOOLS_STAMP)

$(CHROMIUM):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium

browser: $(CHROMIUM)  ## Debian's headless Chromium for the console's browser tests (apt)

# Two workers (pytest-xdist), a test module per worker at a time (--dist loadscope): an e2e
# module's tests share its local cloud by design. Modules are handed out in collection order
# (--no-loadscope-reorder): the longest tests first, each on a worker of its own, then e2e, then
# unit modules (tests/conftest.py). The local clouds run on a scaled clock
# (tests/constants.py TIME_SCALE), so the state machine's real Retry intervals cost moments.
test: setup $(CHROMIUM)  ## the whole suite: unit, e2e, browser and lint tests, then the image tests in each job environment (what CI runs)
	$(BIN)/pytest -n 2 --dist loadscope --no-loadscope-reorder --durations=25
	$(IMAGE_BIN)/pytest tests/image -n 2 --dist loadscope --no-loadscope-reorder --durations=15
	$(ACC_BIN)/pytest tests/image_accelerate -n 2 --dist loadscope --durations=15

# CI runs both replays after `make test` (.ci/run), not in it, each a fresh download of its image's
# stack (PIP_NO_CACHE_DIR=1 as in the images): Dockerfile's 3.5 to 7 minutes here, Dockerfile.accelerate's
# 6.5 (its 6 GB CUDA 13 stack: the pip line 257 s, deleting the scratch most of the rest). Each has its
# own target for work on one image.
# The image's apt line installs g++; the replay does not run apt lines (they would change the host's
# system), so the host's own g++ stands in for it: installed here as that line would.
$(GXX):
	$(SUDO) apt-get update -qq
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++

image-replay: image-replay-colossalai image-replay-accelerate  ## replay both images' Dockerfiles without Docker (.ci/dockerfile_replay.py; minutes)

image-replay-colossalai: $(STAMP) $(GXX)  ## replay training_image/Dockerfile's build steps (the Colossal-AI image)
	$(BIN)/python .ci/dockerfile_replay.py

image-replay-accelerate: $(STAMP)  ## replay training_image/Dockerfile.accelerate's build steps (the accelerate image)
	$(BIN)/python .ci/dockerfile_replay.py --dockerfile training_image/Dockerfile.accelerate

check: test image-replay  ## what CI runs (bash .ci/run): the whole suite, then both images' build steps replayed

test-unit: setup  ## unit tests only (seconds)
	$(BIN)/pytest tests/unit -m "not slow"

test-image: setup  ## the training_image code on CPU, in the job environment
	$(IMAGE_BIN)/pytest tests/image --durations=15

test-accelerate: setup  ## the accelerate backend's tests on CPU, in the second job environment
	$(ACC_BIN)/pytest tests/image_accelerate -n 2 --dist loadscope --durations=15

notebook: $(STAMP) $(IMAGE_STAMP) $(SDK_STAMP)  ## run docs/notebooks/sdk-quickstart.ipynb top to bottom against a fresh local cloud (as CI does)
	$(BIN)/pytest tests/e2e/test_sdk_notebook.py --durations=0

console: $(STAMP)  ## the run console for the local cloud of `sdflow local up` (or AWS with --endpoint-url unset)
	$(BIN)/sdflow console

demo:  ## the whole pipeline on this machine (local runtime), ending with a generated image
	# Only the two venvs the demo runs in (the lint tools' venvs are for `make test`/`make lint`).
	$(MAKE) --no-print-directory -j2 $(STAMP) $(IMAGE_STAMP)
	$(BIN)/sdflow demo

demo-lora:  ## `make demo` with a LoRA adapter on the same scenes: its size beside the full model's, its adherence
	$(MAKE) --no-print-directory -j2 $(STAMP) $(IMAGE_STAMP)
	$(BIN)/sdflow demo --lora

lint: setup  ## ruff, mypy, cfn-lint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy layers/common/sdflow_common sdflow
	$(IMAGE_BIN)/mypy training_image/sdflow_image
	$(BIN)/cfn-lint template.yaml
	$(BIN)/hadolint training_image/Dockerfile training_image/Dockerfile.accelerate

format: setup  ## ruff format + autofix
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup  ## benchmarks: ratios measured side by side in one run
	PYTHONPATH=training_image:. $(IMAGE_BIN)/python bench/bench_train.py
	PYTHONPATH=training_image:. $(IMAGE_BIN)/python bench/bench_download.py
	PYTHONPATH=training_image:. $(IMAGE_BIN)/python bench/bench_data_scale.py
	$(BIN)/python bench/bench_local_runtime.py
	$(BIN)/python bench/bench_sdk_core_layer.py

schema: setup  ## regenerate schemas/run-document.schema.json and docs/run-document.md's field tables from the pydantic model
	PYTHONPATH=layers/common $(BIN)/python -m sdflow_common.run_document > schemas/run-document.schema.json
	PYTHONPATH=layers/common $(BIN)/python -m sdflow_common.run_document_docs --write docs/run-document.md

clean:  ## remove venvs, build output and caches
	rm -rf $(VENV) $(IMAGE_VENV) $(ACC_VENV) $(SDK_VENV) .tools .aws-sam scratch .pytest_cache .mypy_cache .ruff_cache
