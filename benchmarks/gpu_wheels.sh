#!/bin/bash
# The wheels benchmarks/gpu_check.sh needs on the device machine's image (Python 3.12, no network
# there): msgspec, pyzmq and xgrammar with its needs, at the versions of this tree's .venv. Run here,
# in the repository root (`.whl/` is git-ignored); then, with `carry: [".whl"]`:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && \
#     bash benchmarks/gpu_check.sh .whl/tokenizer $OUT
# (.whl/tokenizer: SmolLM2's tokenizer files, copied here from the embedded model's folder).
set -eu
dest=${1:-.whl}
mkdir -p "$dest"
ver() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
plats=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
       --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64)
for pkg in msgspec pyzmq xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plats[@]}" -d "$dest" "$pkg==$(ver "$pkg")"
done
mkdir -p "$dest/tokenizer"
model=$(.venv/bin/python -c "from lorastar.models.default import default_model_dir as d; print(d())")
cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$dest/tokenizer/"
ls -la "$dest" "$dest/tokenizer"
