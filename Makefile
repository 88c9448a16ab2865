# Set-up, tests and serving. Every target creates and fills .venv first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# A CPU build of exactly this torch is what the test machines install without
# gigabytes of CUDA packages; a machine that already has torch keeps it.
TORCH_SPEC ?= torch==2.13.0
PROTO_SRC := $(shell find protos -name '*.proto')

.PHONY: setup test lint protos check-protos serve bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check kvd tests benchmarks

# Regenerates the Python package under protos/ from the .proto sources.
protos: setup
	$(BIN)/python -m kvd_api.generate

serve: setup
	$(BIN)/kvd $(ARGS)

bench: setup
	$(BIN)/python benchmarks/block_pool.py --json benchmarks/results/block_pool.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
