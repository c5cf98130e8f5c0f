"""The agent frameworks people build on, run against the shared `pagedllm serve` (the default
model, no flags, the engine core in its own process): the OpenAI Agents SDK (Responses and Chat
Completions models: tool loops, output_type, streaming) and LangChain (`bind_tools` in every
tool_choice, streamed tool calls, `with_structured_output` both ways). SmolLM2's template takes
no tools, so all of it runs in the generic mode (docs/tool_calling.md). A 135M model may call
its tool again instead of answering: a loop must end in an answer or at `max_turns`, never in
an HTTP error or calls returned as text."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from tests.server.helpers import MODEL

pytestmark = pytest.mark.slow  # a real server

agents = pytest.importorskip("agents")
langchain_openai = pytest.importorskip("langchain_openai")

ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}


# ------------------------------------------------------------------ OpenAI Agents SDK

def _run_agent(server, model_kind: str, stream: bool = False, **agent_kw):
    """Run an agent with an `add` tool; (result or the exception it ended with, the tool's calls)."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)

    set_tracing_disabled(True)  # no network: no trace upload
    calls: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)
        model_cls = OpenAIResponsesModel if model_kind == "responses" else OpenAIChatCompletionsModel
        agent_kw.setdefault("tools", [add])
        agent_kw.setdefault("model_settings", ModelSettings(tool_choice="required", temperature=0, max_tokens=96))
        agent = Agent(name="calc", instructions="Use the add tool to add numbers.",
                      model=model_cls(model=MODEL, openai_client=client), **agent_kw)
        events: list = []
        try:
            if stream:
                run = Runner.run_streamed(agent, "What is 2 + 3?", max_turns=3)
                async for event in run.stream_events():
                    events.append(event)
                return run, events
            return await Runner.run(agent, "What is 2 + 3?", max_turns=3), events
        except agents.exceptions.MaxTurnsExceeded as exc:  # the model kept calling: a finished loop
            return exc, events
        finally:
            await client.close()

    result, events = asyncio.run(main())
    return result, calls, events


@pytest.mark.parametrize("model_kind", ["responses", "chat"])
def test_agents_sdk_tool_loop_finishes(server, model_kind):
    """Turn 1 forced (`tool_choice="required"`, strict tools as the SDK sends them), turn 2 and on
    "auto" (the SDK resets it after a call): no turn is an HTTP error, the call is add(2, 3)."""
    result, calls, _ = _run_agent(server, model_kind)
    assert calls and calls[0] == (2, 3)
    if not isinstance(result, Exception):
        assert isinstance(result.final_output, str) and result.final_output


def test_agents_sdk_streamed_tool_loop(server):
    result, calls, events = _run_agent(server, "responses", stream=True)
    assert calls and calls[0] == (2, 3)
    kinds = {e.type for e in events}
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds


@pytest.mark.parametrize("model_kind", ["responses", "chat"])
def test_agents_sdk_output_type(server, model_kind):
    from agents import ModelSettings
    from pydantic import BaseModel

    class Sum(BaseModel):
        a: int
        b: int
        total: int

    result, _, _ = _run_agent(server, model_kind, tools=[], output_type=Sum,
                              model_settings=ModelSettings(temperature=0, max_tokens=64))
    assert isinstance(result.final_output, Sum)


# ------------------------------------------------------------------ LangChain

@pytest.fixture(scope="module")
def chat_model(server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, model=MODEL, max_tokens=48,
                      temperature=0, max_retries=0)


def _multiply_tool():
    from langchain_core.tools import tool

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    return multiply


@pytest.mark.parametrize("tool_choice", ["any", "multiply"])
def test_langchain_bind_tools_forced_then_loop(chat_model, tool_choice):
    """`tool_choice="any"` (LangChain's "required") with 48 tokens: a real `tool_calls` entry,
    not the JSON as text; its result goes back and turn 2 succeeds."""
    from langchain_core.messages import HumanMessage, ToolMessage

    multiply = _multiply_tool()
    messages = [HumanMessage("What is 6 times 7?")]
    reply = chat_model.bind_tools([multiply], tool_choice=tool_choice).invoke(messages)
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "multiply" and not reply.content
    jsonschema.validate(reply.tool_calls[0]["args"], ADD_SCHEMA)
    messages += [reply, ToolMessage(str(multiply.invoke(reply.tool_calls[0]["args"])),
                                    tool_call_id=reply.tool_calls[0]["id"])]
    second = chat_model.bind_tools([multiply]).invoke(messages)  # "auto"
    assert second.tool_calls or (isinstance(second.content, str) and second.content)


def test_langchain_auto_and_streamed_tool_calls(chat_model):
    multiply = _multiply_tool()
    auto = chat_model.bind_tools([multiply]).invoke("What is 6 times 7?")
    assert auto.tool_calls or (auto.content and not auto.content.lstrip().startswith("{"))
    chunks = list(chat_model.bind_tools([multiply], tool_choice="any").stream("What is 6 times 7?"))
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    assert full.tool_calls and full.tool_calls[0]["name"] == "multiply"
    jsonschema.validate(full.tool_calls[0]["args"], ADD_SCHEMA)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(chat_model, method):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    out = chat_model.with_structured_output(City, method=method).invoke("Name a city and its country.")
    assert isinstance(out, City)


# ------------------------------------------------------------------ cut replies, sampled

def test_responses_required_cut_calls_are_never_text(client):
    """tool_choice "required", parallel calls, a 64-token budget, sampled: a cut response keeps
    its complete calls as function_call items (status incomplete) and never turns them into a
    message holding their JSON."""
    tools = [{"type": "function", "name": "add", "description": "Add two integers",
              "parameters": ADD_SCHEMA, "strict": True},
             {"type": "function", "name": "get_weather", "description": "The weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]}, "strict": True}]
    statuses = []
    for seed in range(12):
        resp = client.responses.create(model=MODEL, input="Add 2 and 3, and get the weather in Paris.",
                                       tools=tools, tool_choice="required", parallel_tool_calls=True,
                                       max_output_tokens=64, temperature=1.0, extra_body={"seed": seed})
        statuses.append(resp.status)
        assert all(item.type == "function_call" for item in resp.output), resp.output
        for item in resp.output:
            jsonschema.validate(json.loads(item.arguments), tools[[t["name"] for t in tools].index(item.name)]["parameters"])
    assert set(statuses) <= {"completed", "incomplete"}
    assert client.responses.create(model=MODEL, input="Hi.", max_output_tokens=4).status in ("completed", "incomplete")


# ------------------------------------------------------------------ pydantic-ai

def test_pydantic_ai_tool_and_output_type(server):
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic import BaseModel
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Total(BaseModel):
        total: int

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key=server.api_key))
    calls: list[tuple[int, int]] = []
    agent = pydantic_ai.Agent(model, output_type=Total, instructions="Use add, then give the total.",
                              model_settings={"temperature": 0, "max_tokens": 64})

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    try:
        result = agent.run_sync("What is 2 + 3?", usage_limits=pydantic_ai.UsageLimits(request_limit=4))
        assert isinstance(result.output, Total)  # its output tool was called with a valid object
    except pydantic_ai.exceptions.UsageLimitExceeded:  # the small model kept calling add
        assert calls and all(c == (2, 3) for c in calls)
