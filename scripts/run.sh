#!/usr/bin/env bash
# Set up .venv and run the main job: generate with the default SmolLM2-135M-Instruct model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/pagedllm generate --chat --max-tokens 64 \
  "What is the capital of France?" \
  "Write a haiku about paged memory." \
  "Give three tips for writing fast Python code." "$@"
