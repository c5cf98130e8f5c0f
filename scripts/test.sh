#!/usr/bin/env bash
# Set up .venv and run the whole test suite offline (what `.ci/run` calls).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test bash scripts/setup-venv.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q --durations=40 "$@"
