#!/usr/bin/env bash
# Set up .venv (skipped when it is current: scripts/setup-venv.sh) and run the whole test suite
# offline (what `.ci/run` calls). pytest prints the 20 slowest tests, the set-up's seconds, how
# many engines and servers the run started and its time against the tier's budget
# (tests/conftest.py); docs/testing.md has the tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test bash scripts/setup-venv.sh
# Every kernel library in every instruction-set variant this CPU runs, compiled once, two at a
# time, into the kernel cache (a second or two when it is current): no test waits on a compiler,
# and tests/unit/test_kernel_isa.py checks each variant from the cache.
.venv/bin/python -m pagedllm.kernels --all-variants --jobs "$(nproc)"
# Bytecode is written (some machines set PYTHONDONTWRITEBYTECODE): every server, engine core and
# worker process of the run then loads pagedllm's compiled modules instead of compiling them
# again, and pytest keeps its rewritten test modules between runs.
unset PYTHONDONTWRITEBYTECODE
export PAGEDLLM_TEST_SETUP_SECONDS="$SECONDS"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The whole suite (no arguments: what CI runs) on two workers (pytest-xdist), tests grouped so that
# each file's module-scoped engines and servers, the session servers and transformers' SmolLM2
# are each built on one worker only (tests/conftest.py: worker_group). A run given arguments (a
# tier, a file, a test) runs in this process alone: the quick tier took 64 s so and 81 s on two
# workers (their start-up). PAGEDLLM_TEST_WORKERS=N sets the workers either way (0: none).
if [ $# -eq 0 ]; then WORKERS="${PAGEDLLM_TEST_WORKERS:-2}"; else WORKERS="${PAGEDLLM_TEST_WORKERS:-0}"; fi
PARALLEL=()
if [ "$WORKERS" != 0 ]; then
  PARALLEL=(-n "$WORKERS" --dist loadgroup --no-loadscope-reorder)
  # One OpenMP / torch thread per process: two workers each running two threads on two cores
  # made every test about 1.5x slower than alone (threads spinning against each other); six
  # integration files took 195 s that way and 72 s with one thread each.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
exec .venv/bin/python -m pytest -q "${PARALLEL[@]}" "$@"
