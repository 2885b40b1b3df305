#!/bin/bash
# Everything a GPU machine should run, time-boxed, in one call (the wheels and tokenizer it needs
# there: benchmarks/gpu_wheels.sh, which shows the whole `run` command):
#   benchmarks/gpu_check.sh TOKENIZER_DIR OUT_DIR [OTHER_LORASTAR_PARENT]
# TOKENIZER_DIR: a folder with SmolLM2's tokenizer files (tokenizer.json, tokenizer_config.json);
# OUT_DIR: logs, tables and plots; OTHER_LORASTAR_PARENT: a folder holding another checkout's
# lorastar/ package (e.g. `git archive <rev> lorastar | tar -x -C DIR`), run by the same throughput
# script right after this tree's for a side-by-side before/after. Time boxes (seconds, env):
# TESTS_S 240 (TEST_ARGS: more pytest arguments, e.g. "-n 3 --dist loadfile"), TPUT_S 400 (TPUT_ARGS, default "--sync --unstacked": one-step-at-a-time and separate-shrink
# columns; e.g. TPUT_ARGS="--targets q_proj,k_proj,v_proj,o_proj --batches 1,16,64,64"; COMPACT=1 adds runs with the
# expand's compact grid, REGEX=1 one request of each batch under a regex), PROFILE_S 0 (> 0: gpu_step_profile.py first, adapters on q/k/v/o, both
# expand grids), KERN_S 120 each for kernels and LoRA step;
# a session's device time is 900 s in all, machine start included: KERN_S=0 skips those two.
# The GPU image lacks msgspec, pyzmq and xgrammar (with apache-tvm-ffi, pydantic, pydantic-core,
# annotated-types, typing-inspection): carry them as wheels and put them on PYTHONPATH first.
set -u
# A time box of 0 skips that part (coreutils' `timeout 0` would mean no limit at all).
for v in TESTS_S TPUT_S KERN_S; do [ "${!v:-1}" = 0 ] && eval "$v=skip"; done
tok=$(realpath "$1"); out=$(realpath -m "$2"); other=${3:+$(realpath "$3")}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export LORASTAR_TEST_TOKENIZER=$tok PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}
base=${PYTHONPATH:+$PYTHONPATH:}
per_test=$($py -c "import pytest_timeout" 2>/dev/null && echo "--timeout 120")  # where the plugin is installed
if [ "${PROFILE_S:-0}" -gt 0 ]; then
  t0=$(date +%s)
  PYTHONPATH=$base$PWD timeout "$PROFILE_S" $py benchmarks/gpu_step_profile.py --tokenizer "$tok" --out "$out" \
    --targets q_proj,k_proj,v_proj,o_proj --compact > "$out/gpu_step_profile.log" 2>&1
  echo "step profile rc=$? in $(( $(date +%s) - t0 )) s"; grep "^|" "$out/gpu_step_profile.log" | head -24
fi
t0=$(date +%s)
[ "${TESTS_S:-240}" != skip ] && PYTHONPATH=$base$PWD timeout "${TESTS_S:-240}" $py -m pytest -q -m gpu -p no:cacheprovider $per_test -rfE ${TEST_ARGS:-} \
  tests/kernels tests/engine/test_cuda_graphs.py tests/engine/test_async_scheduling.py tests/models/test_gpu_engine.py \
  tests/quant tests/engine/test_structured_outputs.py tests/engine/test_spec_decode_gpu.py tests/engine/test_embed.py > "$out/gpu_tests.log" 2>&1
echo "gpu tests rc=$? in $(( $(date +%s) - t0 )) s"; tail -3 "$out/gpu_tests.log"
t0=$(date +%s)
[ "${TPUT_S:-400}" != skip ] && PYTHONPATH=$base$PWD timeout "${TPUT_S:-400}" $py benchmarks/gpu_throughput.py --tokenizer "$tok" --out "$out" ${PEFT:---no-peft} \
  ${TPUT_ARGS---sync --unstacked} ${COMPACT:+--compact} ${REGEX:+--regex} > "$out/gpu_throughput.log" 2>&1
echo "throughput rc=$? in $(( $(date +%s) - t0 )) s"; grep "^B=\|roof" "$out/gpu_throughput.log"
if [ -n "$other" ] && [ "${TPUT_S:-300}" != skip ]; then
  mkdir -p "$out/other"; t0=$(date +%s)
  PYTHONPATH=$base$other timeout "${TPUT_S:-300}" $py benchmarks/gpu_throughput.py --tokenizer "$tok" --out "$out/other" \
    ${PEFT:---no-peft} > "$out/other/gpu_throughput.log" 2>&1
  echo "other checkout rc=$? in $(( $(date +%s) - t0 )) s"; grep "^B=" "$out/other/gpu_throughput.log"
fi
t0=$(date +%s)
[ "${KERN_S:-120}" != skip ] && PYTHONPATH=$base$PWD timeout "${KERN_S:-120}" $py benchmarks/kernels.py --quick --out "$out" > "$out/kernels.log" 2>&1
echo "kernels rc=$? in $(( $(date +%s) - t0 )) s"
[ "${KERN_S:-120}" != skip ] && PYTHONPATH=$base$PWD timeout "${KERN_S:-120}" $py benchmarks/lora_graph_step.py --out "$out" > "$out/lora_graph_step.log" 2>&1
echo "lora_graph_step rc=$?"; tail -26 "$out/lora_graph_step.log" | grep "^|" | head -30
