"""Strict tools under tool_choice "auto", sampled: how many calls a model makes and how many of
them parse against their tool's schema, through a real `pagedllm serve`.

Two servers, one after the other, each given `--turns` chat turns at temperature 1 (one seed a
turn) with two strict tools and prompts that ask for them or not:

- `generic`: the default model with no flags (its template has no tool format: the generic
  envelope, constrained from the first token);
- `hermes`: the default model with Qwen2.5's tool template (`<tool_call>` markers, the hermes
  parser) and `--tool-call-parser hermes`: free text until `<tool_call>`, then the call
  constrained by the tool's schema (xgrammar's structural tag).

Reported per server: turns, turns with calls, calls, calls whose arguments validate against
their tool's schema (the target: all of them), turns answered in free text, HTTP errors; and
the completion tokens of a forced `add(a=2, b=3)`.

    flock /tmp/pagedllm-cpu.lock .venv/bin/python -m benchmarks.tool_calls [--turns 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import httpx
import jsonschema

from benchmarks.serve_process import serving

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city", "strict": True,
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TOOLS = [ADD, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = ["What is 17 + 25?", "What's the weather in Lisbon?", "Tell me a joke.", "Add 3 and 4.",
           "Is it raining in Oslo, in fahrenheit?", "Write one sentence about the sea."]


def run_turns(base: str, turns: int) -> dict:
    out = {"turns": turns, "turns_with_calls": 0, "calls": 0, "calls_valid": 0, "free_text_turns": 0,
           "http_errors": 0, "invalid_examples": []}
    with httpx.Client(base_url=base, timeout=300) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for i in range(turns):
            body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    "tools": TOOLS, "tool_choice": "auto", "temperature": 1.0, "seed": i, "max_tokens": 96}
            r = client.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                out["http_errors"] += 1
                continue
            message = r.json()["choices"][0]["message"]
            calls = message.get("tool_calls") or []
            if not calls:
                out["free_text_turns"] += 1
                continue
            out["turns_with_calls"] += 1
            for call in calls:
                out["calls"] += 1
                try:
                    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
                    out["calls_valid"] += 1
                except (ValueError, KeyError, jsonschema.ValidationError):
                    out["invalid_examples"].append(call["function"])
        forced = client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "Add 2 and 3."}], "tools": [ADD],
            "tool_choice": "required", "temperature": 0}).json()
        out["forced_add_tokens"] = forced["usage"]["completion_tokens"]
        out["forced_add_arguments"] = forced["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    out["invalid_examples"] = out["invalid_examples"][:3]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=200)
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.server.tool_templates import QWEN25_TOOL_TEMPLATE

    with tempfile.NamedTemporaryFile("w", suffix=".jinja", delete=False) as f:
        f.write(QWEN25_TOOL_TEMPLATE)
    common = ["--kv-cache-space", "0.5", "--max-model-len", "2048"]
    for name, extra in (("generic", []), ("hermes", ["--chat-template", f.name, "--tool-call-parser", "hermes"])):
        with serving(common + extra) as base:
            result = run_turns(base, args.turns)
        print(json.dumps({"server": name, **result}), flush=True)
    os.unlink(f.name)


if __name__ == "__main__":
    main()
