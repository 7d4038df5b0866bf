# autotune: two user-facing commands, `make demo` and `make test` (plus `make install`), and `make check`,
# the developers' fast loop (lint, format, the unit tests: under 3 minutes on 2 cores).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test check lint gpu-check clean engines titan-site

install: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned to the CPU build on local disk; the range in pyproject admits it.
	$(BIN)/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '.[dev,engines]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/autotune search --cluster mixed-a100-v100 --model gpt2-xl --budget 60 --output best.json

# everything CI runs (.ci/run): lint and format, then the unit and the integration tests, two test files at a
# time (pytest-xdist; a file's tests in order on one worker): much of the suite waits on subprocesses and I/O
test: lint engines
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# the engines' own configuration code for tests/integration/engines (torchtitan 0.3, Megatron-Core 0.19's
# argument parser; DeepSpeed is in the venv): in .engines/site, beside the venv. Without a package index the
# install fails, says so, and those tests skip saying why.
ENGINES := .engines/site
engines: .engines/.installed

.engines/.installed: requirements-engines.txt | $(STAMP)
	rm -rf $(ENGINES) && mkdir -p $(ENGINES)
	( $(BIN)/pip install -q --target $(ENGINES) --no-deps -r requirements-engines.txt && \
	  $(BIN)/pip install -q --target $(ENGINES) --no-deps --python-version 3.12 --only-binary=:all: \
	    megatron-core==0.19.2 && touch $@ ) || echo "engine parsers not installed: tests/integration/engines skips them"

# torchtitan and what it imports, without triton and Megatron (42 MB, a CUDA torch brings its own triton): what
# scripts/titan_gpu_check.py needs on a GPU machine without a package index (carry .engines/titan there)
titan-site: engines
	rm -rf .engines/titan && mkdir -p .engines/titan
	cd $(ENGINES) && cp -r $$(ls | grep -v -E '^(triton|megatron|bin)') ../titan/

# the inner loop: lint and format, then tests/unit only (no processes, servers or MLflow stores), less the unit
# tests marked slow (whole searches, a policy's training, sweeps: each over ~5 s on 2 idle cores); make test runs them
check: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests/unit -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# simulator vs real runs on the one CUDA GPU here (< 8 min); without CUDA it says so and exits 0
gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py

clean:
	rm -rf $(VENV) .engines *.egg-info mlflow.db mlflow.db-* optuna.db optuna.journal* mlruns
