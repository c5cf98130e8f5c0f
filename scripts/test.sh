#!/usr/bin/env bash
# Set up .venv (skipped when it is current: scripts/setup-venv.sh) and run the whole test suite
# offline (what `.ci/run` calls). pytest prints the 40 slowest tests, the set-up's seconds and
# how many engines and servers the run started (tests/conftest.py); docs/testing.md has the tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test bash scripts/setup-venv.sh
export PAGEDLLM_TEST_SETUP_SECONDS="$SECONDS"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q --durations=40 "$@"
