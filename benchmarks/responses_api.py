"""/v1/responses against a real `pagedllm serve` of the default model (issue 46), through the
official `openai` client: the prefix-cache hit of a `previous_response_id` continuation, the
event sequence of one streamed function call, background responses (time to the queued answer,
cancel to an idle engine), what is refused by name, and the response store's memory at 10,000
responses (in this process, tracemalloc, with a real response as the entry).

    flock /tmp/pagedllm-cpu.lock .venv/bin/python -m benchmarks.responses_api [--repeats 3]

The server: `--max-model-len 2048 --kv-cache-space 0.5`, engine core in its own process.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import time
import tracemalloc

import httpx
import openai

from benchmarks.serve_process import serving

ADD = {"type": "function", "name": "add", "description": "Add two integers", "strict": False,
       "parameters": {"type": "object", "additionalProperties": False,
                      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}


SERVE_ARGS = ["--max-model-len", "2048", "--kv-cache-space", "0.5"]


def _idle(http: httpx.Client, timeout: float = 30.0) -> float:
    """Seconds until nothing runs and no KV block is held."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        text = http.get("/metrics").text
        running = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running{")]
        used = [ln for ln in text.splitlines()
                if ln.startswith("pagedllm:kv_cache_used_blocks{")]
        if all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in running + used):
            return time.monotonic() - t0
        time.sleep(0.01)
    return float("nan")


def continuation(client: openai.OpenAI, model: str, repeats: int) -> tuple[list, dict]:
    rows, first = [], None
    for r in range(repeats):
        facts = " ".join(f"Run {r}, fact {i}: {i} squared is {i * i}." for i in range(40))
        a = client.responses.create(model=model, input=facts + " Summarize.", temperature=0,
                                    max_output_tokens=16)
        b = client.responses.create(model=model, input="And the last fact?", temperature=0,
                                    max_output_tokens=16, previous_response_id=a.id)
        cached = b.usage.input_tokens_details.cached_tokens
        rows.append((a.usage.input_tokens, b.usage.input_tokens, cached,
                     cached / a.usage.input_tokens))
        first = first or a
    return rows, first.model_dump(mode="json")


def tool_call_events(client: openai.OpenAI, model: str) -> list[str]:
    events = list(client.responses.create(
        model=model, input="Add 2 and 3.", tools=[ADD], stream=True, temperature=0,
        tool_choice={"type": "function", "name": "add"}, max_output_tokens=40))
    out = []
    for kind, group in itertools.groupby(e.type for e in events):
        n = len(list(group))
        out.append(f"{kind} x{n}" if n > 1 else kind)
    return out


def background(client: openai.OpenAI, http: httpx.Client, model: str,
               repeats: int) -> dict[str, float]:
    queued, foreground, cancel_idle = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        q = client.responses.create(model=model, input="Say hello.", background=True,
                                    temperature=0, max_output_tokens=32)
        queued.append(time.perf_counter() - t0)
        while client.responses.retrieve(q.id).status in ("queued", "in_progress"):
            time.sleep(0.01)
        t0 = time.perf_counter()
        client.responses.create(model=model, input="Say hello.", temperature=0,
                                max_output_tokens=32)
        foreground.append(time.perf_counter() - t0)
        long = client.responses.create(model=model, input="Count to a thousand.",
                                       background=True, max_output_tokens=1500,
                                       extra_body={"ignore_eos": True})
        while client.responses.retrieve(long.id).status != "in_progress":
            time.sleep(0.01)
        time.sleep(0.3)
        t0 = time.perf_counter()
        assert client.responses.cancel(long.id).status == "cancelled"
        _idle(http)
        cancel_idle.append(time.perf_counter() - t0)
    return {"queued answer (s)": statistics.median(queued),
            "same request in the foreground (s)": statistics.median(foreground),
            "cancel -> engine idle (s)": statistics.median(cancel_idle)}


REFUSALS = [
    ("truncation auto", dict(truncation="auto")),
    ("include", dict(include=["reasoning.encrypted_content"])),
    ("stored prompt", dict(prompt={"id": "pmpt_1"})),
    ("background without store", dict(background=True, store=False)),
    ("reasoning.effort, template without it", dict(reasoning={"effort": "high"})),
    ("reasoning.summary", dict(reasoning={"summary": "auto"})),
    ("hosted tool", dict(tools=[{"type": "web_search"}])),
    ("tool_choice auto without --tool-call-parser", dict(tools=[ADD])),
    ("json_schema without schema", dict(text={"format": {"type": "json_schema", "name": "x"}})),
    ("schema the grammar refuses", dict(text={"format": {"type": "json_schema", "name": "x",
                                                         "schema": {"type": "string",
                                                                    "pattern": "("}}})),
    ("unknown item type", dict(input=[{"type": "item_reference", "id": "x"}])),
    ("output for an unknown call_id", dict(input=[{"type": "function_call_output",
                                                   "call_id": "nope", "output": "1"}])),
    ("image part", dict(input=[{"role": "user", "content": [{"type": "input_image",
                                                             "image_url": "http://x"}]}])),
    ("unknown previous_response_id", dict(previous_response_id="resp_" + "0" * 48)),
]


def refusals(client: openai.OpenAI, model: str) -> list[tuple[str, int, str, str]]:
    rows = []
    for name, kw in REFUSALS:
        kw.setdefault("input", "Hi.")
        try:
            client.responses.create(model=model, max_output_tokens=2, **kw)
            rows.append((name, 200, "", "ACCEPTED"))
        except openai.APIStatusError as exc:
            body = exc.body if isinstance(exc.body, dict) else {}
            rows.append((name, exc.status_code, str(body.get("param")), str(body.get("message"))))
    return rows


def store_memory(response: dict, n: int = 10_000) -> list[tuple[str, int, int, int]]:
    from pagedllm.entrypoints.openai.response_store import (
        DEFAULT_MAX_BYTES,
        DEFAULT_MAX_ENTRIES,
        ResponseStore,
        new_response_id,
    )

    items = [{"id": "msg_0", "type": "message", "role": "user", "status": "completed",
              "content": [{"type": "input_text", "text": "x" * 2000}]}]
    rows = []
    for label, entries, max_bytes in (("defaults", DEFAULT_MAX_ENTRIES, DEFAULT_MAX_BYTES),
                                      ("--responses-store-max-bytes 2097152",
                                       DEFAULT_MAX_ENTRIES, 2 * 1024 * 1024)):
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        store = ResponseStore(entries, max_bytes)
        for _ in range(n):
            r = copy.deepcopy(response)
            r["id"] = new_response_id()
            store.put(None, r, copy.deepcopy(items))
        heap = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        rows.append((label, len(store), store.bytes, heap))
        del store
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with serving(SERVE_ARGS) as base, httpx.Client(base_url=base, timeout=120) as http:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="EMPTY", max_retries=0)
        model = client.models.list().data[0].id
        rows, response = continuation(client, model, args.repeats)
        print("## previous_response_id continuation (prefix cache)\n")
        print("| first turn input tokens | second turn input tokens | cached | cached / first |")
        print("|---|---|---|---|")
        for a, b, c, ratio in rows:
            print(f"| {a} | {b} | {c} | {ratio:.3f} |")
        print(f"\nmedian cached / first-turn prompt: "
              f"{statistics.median(r[3] for r in rows):.3f}\n")
        print("## one streamed function call (tool_choice named), its events\n")
        print(" -> ".join(tool_call_events(client, model)) + "\n")
        print(f"## background responses (medians of {args.repeats})\n")
        for k, v in background(client, http, model, args.repeats).items():
            print(f"- {k}: {v:.3f}")
        print("\n## refused by name\n")
        print("| input | status | param | message |\n|---|---|---|---|")
        for name, status, param, msg in refusals(client, model):
            print(f"| {name} | {status} | {param} | {msg[:160]} |")
        health = http.get("/health").status_code
        plain = client.responses.create(model=model, input="Hi.", max_output_tokens=2)
        print(f"\nafterwards: /health {health}, a plain request: {plain.status}\n")
    print("## the store at 10,000 responses (a real response object + a 2,000-character input)\n")
    print("| bounds | kept | JSON bytes counted | Python heap (tracemalloc) |\n|---|---|---|---|")
    for label, kept, counted, heap in store_memory(response):
        print(f"| {label} | {kept} | {counted / 1e6:.1f} MB | {heap / 1e6:.1f} MB |")


if __name__ == "__main__":
    main()
