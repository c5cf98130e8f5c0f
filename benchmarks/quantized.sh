#!/usr/bin/env bash
# Issue 11's targets table: weight memory, held-out perplexity, and seed20 / burst200 / single
# throughput per format and compute path, with pagedllm float32 and vLLM-CPU float32 in the same
# run. Each benchmark takes the CPU lock on its own (nothing else may run while it times).
#   Q=/tmp/q bash benchmarks/quantized.sh          # Q: where the quantized folders are (made below if absent)
# Needs .venv (EXTRAS=bench) and .venv-vllm (see benchmarks/side_by_side.sh). About 45 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
Q=${Q:-/tmp/q}
OUT=${OUT:-benchmarks/results/quantized}
mkdir -p "$OUT"
LOCK=(flock /tmp/pagedllm-cpu.lock)
F=$("$PY" -c "from benchmarks.throughput import hf_export; print(hf_export(None))")  # SmolLM2 float32 folder
quant() { [ -d "$Q/$1" ] || "${LOCK[@]}" .venv/bin/pagedllm quantize "$F" "${@:2}" --out "$Q/$1"; }
quant gptq4-ao --method gptq --act-order --bits 4 --group-size 64 --format gptq
quant awq4 --method awq --bits 4 --group-size 64 --format awq
quant rtn4 --method rtn --bits 4 --group-size 64 --format gptq
quant w8a8 --method rtn --bits 8 --group-size -1 --format compressed-tensors --activations int8

echo "## weight memory"
"${LOCK[@]}" "$PY" -m benchmarks.weight_memory default "$F" "$Q/gptq4-ao" "$Q/awq4" "$Q/rtn4" "$Q/w8a8" \
  --label "default=GGUF Q4_1 (default model)" --label "$F=float32 folder" --json-out "$OUT/memory.jsonl"
PAGEDLLM_GGUF_BLOCKS=0 "${LOCK[@]}" "$PY" -m benchmarks.weight_memory default --json-out "$OUT/memory.jsonl" | tail -1

echo "## perplexity (held-out text)"
"${LOCK[@]}" "$PY" -m benchmarks.perplexity "$F" default@exact default@int8 "$Q/gptq4-ao@exact" "$Q/gptq4-ao@int8" \
  "$Q/awq4@exact" "$Q/awq4@int8" "$Q/rtn4@exact" "$Q/rtn4@int8" "$Q/w8a8" --hf-reference "$F" \
  --json-out "$OUT/perplexity.json"

tp() { "${LOCK[@]}" "$PY" -m benchmarks.throughput --repeats 3 --json-out "$OUT/throughput.jsonl" "$@"; }
echo "## seed20"
tp --workload seed20 --compare pagedllm,vllm --vllm-python .venv-vllm/bin/python
tp --workload seed20 --quant-compute int8
tp --workload seed20 --model "$F"
for m in gptq4-ao awq4 w8a8; do tp --workload seed20 --model "$Q/$m"; done
tp --workload seed20 --model "$Q/gptq4-ao" --quant-compute exact
echo "## burst200"
tp --workload burst200 --compare pagedllm,vllm --vllm-python .venv-vllm/bin/python
tp --workload burst200 --quant-compute int8
tp --workload burst200 --model "$Q/gptq4-ao"
echo "## single"
tp --workload single --compare pagedllm,vllm --vllm-python .venv-vllm/bin/python
tp --workload single --quant-compute int8
tp --workload single --model "$Q/gptq4-ao"
