#!/usr/bin/env bash
# Set up .venv and run the main job: the OpenAI-compatible server with the default
# SmolLM2-135M-Instruct model on http://127.0.0.1:8000 (extra flags are passed to `serve`).
set -euo pipefail
cd "$(dirname "$0")/.."
# with xgrammar (the `structured` extra): JSON mode and structured outputs work out of the box,
# as in vLLM; the server itself does not need it (it is imported on the first constrained request)
EXTRAS="${EXTRAS:-structured}" bash scripts/setup-venv.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cat <<'USAGE'
Starting the pagedllm server on http://127.0.0.1:8000 (ready at "Application startup complete").
Call it from another terminal:

  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64}'

  curl -N http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 32, "stream": true}'

Or with the openai client (.venv/bin/pip install openai), in Python:

from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="EMPTY")
r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=64,
        messages=[{"role": "user", "content": "Write a haiku about paged memory."}])
print(r.choices[0].message.content)

JSON mode:

  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "A city and its country, as JSON"}], "response_format": {"type": "json_object"}, "max_tokens": 64}'

Metrics: curl http://127.0.0.1:8000/metrics    Stop the server: Ctrl-C.
USAGE
exec .venv/bin/pagedllm serve --host 127.0.0.1 --port 8000 "$@"
