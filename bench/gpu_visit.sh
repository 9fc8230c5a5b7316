#!/usr/bin/env bash
# Everything one visit to a lent CUDA machine measures, in one command (logs and JSON under $OUT):
#   1. bench/triton_kernels.py: Triton W4A16/W8A16 GEMV and GEMM against tinygemm and cuBLAS
#   2. bench/runtime_gpu.py: decode of a Llama-3-8B-shaped model, bf16 and W4, against transformers
#   3. tests/runtime/test_triton_kernels.py compiled on the GPU (gpu-marked tests included)
# The machine has torch, transformers and triton but no package index: lmpress's other
# dependencies travel as wheels in .whl/ (see the device notes), e.g. from the checkout:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl pydantic pydantic-core annotated-types typing-inspection \
#     typing-extensions gguf
# usage there: bash bench/gpu_visit.sh [SECONDS_FOR_KERNELS SECONDS_FOR_DECODE SECONDS_FOR_TESTS]
set -u
out=${OUT:-/tmp/gpu-visit}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/gpu.txt"
set -o pipefail
start=$SECONDS
timeout "${1:-200}" python3 bench/triton_kernels.py --out "$out/triton_kernels.json" 2>&1 | tee "$out/triton_kernels.log"
echo "kernels: rc $? after $((SECONDS - start)) s"
timeout "${2:-280}" python3 bench/runtime_gpu.py --new-tokens 64 --out "$out/runtime_gpu.json" 2>&1 | tee "$out/runtime_gpu.log"
echo "decode: rc $? after $((SECONDS - start)) s"
timeout "${3:-120}" python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_triton_kernels.py 2>&1 | tee "$out/tests.log"
echo "tests: rc $? after $((SECONDS - start)) s"
