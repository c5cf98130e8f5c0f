"""What each agent framework sends and what comes back, against `pagedllm serve` with no flags
(the default model, the engine core in its own process): the rows of issue 60's table, run as
the frameworks' users run them. Every HTTP request a client makes is recorded (its fields, with
`tools` / `tool_choice` / `strict` / `parallel_tool_calls` spelled out) with the status and the
reply's shape (tool calls, text, finish reason / status).

    python -m benchmarks.agent_clients [--base-url URL]   # default: starts its own server
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import httpx
import openai

from benchmarks.serve_process import serving

ROWS: list[dict[str, Any]] = []


def _summary(body: dict[str, Any]) -> dict[str, Any]:
    keep = {k: body[k] for k in ("tool_choice", "parallel_tool_calls", "max_tokens", "max_output_tokens",
                                 "max_completion_tokens", "temperature", "stream", "response_format", "text")
            if k in body}
    if body.get("tools"):
        keep["tools"] = [{"name": t.get("name") or t.get("function", {}).get("name"),
                          "strict": t.get("strict", t.get("function", {}).get("strict"))} for t in body["tools"]]
    return keep


def _reply(resp: httpx.Response, body: bytes) -> dict[str, Any]:
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        return {"status": resp.status_code, "stream": True}
    try:
        data = json.loads(body)
    except ValueError:
        return {"status": resp.status_code}
    if isinstance(data.get("error"), dict):
        return {"status": resp.status_code, "error": data["error"].get("message", "")[:200]}
    if "choices" in data:
        c = data["choices"][0]
        msg = c["message"]
        return {"status": resp.status_code, "finish_reason": c["finish_reason"],
                "tool_calls": [(t["function"]["name"], t["function"]["arguments"]) for t in msg.get("tool_calls") or []],
                "content": (msg.get("content") or "")[:80], "completion_tokens": data["usage"]["completion_tokens"]}
    if data.get("object") == "response":
        return {"status": resp.status_code, "response_status": data["status"],
                "items": [(i["type"], i.get("name"), i.get("arguments")) if i["type"] == "function_call"
                          else (i["type"], "".join(p.get("text", "") for p in i.get("content", []))[:80])
                          for i in data["output"]]}
    return {"status": resp.status_code}


def recording_clients(row: str) -> tuple[httpx.Client, httpx.AsyncClient]:
    """httpx clients that record each exchange under `row`."""
    def on_request(request: httpx.Request) -> None:
        request.extensions["sent"] = _summary(json.loads(request.content or b"{}"))

    def on_response(response: httpx.Response) -> None:
        response.read()
        ROWS.append({"row": row, "path": response.request.url.path, "sent": response.request.extensions["sent"],
                     "came_back": _reply(response, response.content)})

    async def a_on_request(request: httpx.Request) -> None:
        on_request(request)

    async def a_on_response(response: httpx.Response) -> None:
        await response.aread()
        ROWS.append({"row": row, "path": response.request.url.path, "sent": response.request.extensions["sent"],
                     "came_back": _reply(response, response.content)})

    return (httpx.Client(event_hooks={"request": [on_request], "response": [on_response]}, timeout=300),
            httpx.AsyncClient(event_hooks={"request": [a_on_request], "response": [a_on_response]}, timeout=300))


def agents_sdk(base: str, model: str, kind: str) -> str:
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    from agents.exceptions import MaxTurnsExceeded

    set_tracing_disabled(True)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    row = f"Agents SDK {kind}, tool_choice required then auto"

    async def main() -> str:
        _, http = recording_clients(row)
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", http_client=http, max_retries=0)
        cls = OpenAIResponsesModel if kind == "responses" else OpenAIChatCompletionsModel
        agent = Agent(name="calc", instructions="Use the add tool to add numbers.", tools=[add],
                      model=cls(model=model, openai_client=client),
                      model_settings=ModelSettings(tool_choice="required", max_tokens=96))
        try:
            result = await Runner.run(agent, "What is 2 + 3?", max_turns=4)
            return f"final output {result.final_output!r}"
        except MaxTurnsExceeded:
            return "ended at max_turns (the model kept calling add)"
        finally:
            await http.aclose()

    return asyncio.run(main())


def langchain(base: str, model: str) -> str:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    http, _ = recording_clients("LangChain bind_tools tool_choice any, max_tokens 48")
    llm = ChatOpenAI(base_url=f"{base}/v1", api_key="none", model=model, max_tokens=48, http_client=http)
    reply = llm.bind_tools([multiply], tool_choice="any").invoke("What is 6 times 7?")
    return f"tool_calls {reply.tool_calls}"


def responses_required(base: str, model: str) -> str:
    http, _ = recording_clients("/v1/responses required, max_output_tokens 64, sampled x12")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", http_client=http, max_retries=0)
    tools = [{"type": "function", "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}, "strict": True},
        {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}}, "required": ["city"]}, "strict": True}]
    statuses = []
    for seed in range(12):
        r = client.responses.create(model=model, input="Add 2 and 3, and get the weather in Paris.", tools=tools,
                                    tool_choice="required", parallel_tool_calls=True, max_output_tokens=64,
                                    temperature=1.0, extra_body={"seed": seed})
        statuses.append((r.status, [i.type for i in r.output]))
    return f"{statuses}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None)
    args = p.parse_args()

    def run(base: str) -> None:
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        outcomes = {"Agents SDK responses": agents_sdk(base, model, "responses"),
                    "Agents SDK chat": agents_sdk(base, model, "chat"),
                    "LangChain": langchain(base, model),
                    "responses required": responses_required(base, model)}
        for row in ROWS:
            print(json.dumps(row, ensure_ascii=False))
        for name, outcome in outcomes.items():
            print(f"# {name}: {outcome}")

    if args.base_url:
        run(args.base_url)
    else:
        with serving([]) as base:
            run(base)


if __name__ == "__main__":
    main()
