"""The /v1/responses request body and its translation into a chat completion request: the
Responses API is a second protocol over the chat path (templates, tool parsers, reasoning
parsers, the grammar engine), not a second engine path.

Translation: `instructions` -> a system message first; `input` (a string, or items) -> chat
messages: `message` items (text parts; `input_image` parts -> chat's `image_url` parts when the
model takes images), `function_call` items -> an assistant message's
`tool_calls` (consecutive calls, and calls following an assistant message, join that
message), `function_call_output` -> a `tool` message (its `call_id` must name an earlier
call), `reasoning` items -> dropped (chat templates drop earlier turns' reasoning too).
`tools` (flat function tools) / `tool_choice` -> chat's; `text.format` -> `response_format`;
`max_output_tokens` -> `max_completion_tokens`. A field pagedllm does not implement is a 400
naming it (`REFUSED_FIELDS`), never accepted and ignored; vLLM's sampling extras that chat
takes pass through (`PASSTHROUGH_FIELDS`); any other unknown field is named in the
X-Pagedllm-Ignored-Fields header, as on chat.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from pagedllm.entrypoints.openai.chat_protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol_base import OpenAIBaseModel
from pagedllm.entrypoints.openai.sampling_request import first_refused

# Responses fields pagedllm does not implement -> why; refused unless null / their no-op value.
REFUSED_FIELDS: dict[str, str] = {
    "include": "no extra output data can be included (no hosted tools, no logprobs, no "
    "encrypted reasoning)",
    "prompt": "stored prompt templates are not supported; send `instructions` and `input`",
    "conversation": "conversation objects are not supported; use `previous_response_id`",
    "truncation": "truncation 'auto' is not supported; a prompt over the context is a 400",
    "max_tool_calls": "a limit on hosted tool calls does not apply (function tools only)",
    "top_logprobs": "logprobs are not returned by /v1/responses; use /v1/chat/completions",
    "service_tier": "there are no service tiers",
    "prompt_cache_key": "the prefix cache is automatic; use vLLM's `cache_salt` to keep "
    "tenants apart",
    "prompt_cache_retention": "the prefix cache is automatic; its retention cannot be set",
    "stream_options": "no stream options are supported",
    "context_management": "context management is not supported",
}
_NOOP_VALUES: dict[str, tuple] = {"include": ([],),
                                  "truncation": ("disabled",),
                                  "service_tier": ("auto", "default")}
# vLLM's sampling fields chat takes, passed through as they are.
PASSTHROUGH_FIELDS = ("top_k", "min_p", "repetition_penalty", "frequency_penalty",
                      "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
                      "min_tokens", "structured_outputs", "cache_salt", "priority",
                      "request_id", "logit_bias", "chat_template_kwargs")
# accepted and recorded, nothing to do (OpenAI's own abuse-tracking id)
_RECORDED_FIELDS = ("safety_identifier",)
_TEXT_PARTS = ("input_text", "output_text", "text")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def refuse(message: str, param: str, status: int = 400) -> OpenAIError:
    return OpenAIError(message, status, param=param)


class ResponsesRequest(OpenAIBaseModel):
    # https://platform.openai.com/docs/api-reference/responses/create
    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # unset: the server's default for its tool format
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = True
    stream: bool | None = False
    previous_response_id: str | None = None
    background: bool | None = False

    def refused_field(self) -> tuple[str, str] | None:
        return first_refused(self.model_extra, REFUSED_FIELDS, _NOOP_VALUES)

    def ignored_fields(self) -> list[str]:
        known = set(REFUSED_FIELDS) | set(PASSTHROUGH_FIELDS) | set(_RECORDED_FIELDS)
        return sorted(k for k in (self.model_extra or {}) if k not in known)

    def check(self) -> None:
        """400s for what the request asks and pagedllm does not do, by field name."""
        refused = self.refused_field()
        if refused is not None:
            name, why = refused
            raise refuse(f"The request field `{name}` is not supported by this server: {why}.",
                         name)
        if self.metadata is not None:
            if len(self.metadata) > 16:
                raise refuse("`metadata` takes at most 16 keys.", "metadata")
            for k, v in self.metadata.items():
                if len(k) > 64 or len(v) > 512:
                    raise refuse("`metadata` keys are at most 64 characters and values at "
                                 "most 512.", "metadata")
        if self.background and self.store is False:
            raise refuse("`background`: a background response must be stored (`store` true): "
                         "it is polled with GET /v1/responses/{id}.", "background")
        reasoning = self.reasoning or {}
        for key, value in reasoning.items():
            if key == "effort" and value is not None and value not in REASONING_EFFORTS:
                raise refuse(f"`reasoning.effort` must be one of {', '.join(REASONING_EFFORTS)}"
                             f", got {value!r}.", "reasoning.effort")
            if key != "effort" and value is not None:
                raise refuse(f"`reasoning.{key}` is not supported: no reasoning summaries are "
                             "produced; the reasoning comes back whole as `reasoning` items "
                             "(with the server's --reasoning-parser).", f"reasoning.{key}")

    # ------------------------------------------------------------------ translation

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def to_chat(self, history: list[dict[str, Any]],
                takes_images: bool = False) -> ChatCompletionRequest:
        """The chat completion request that runs this one; `history`: the items of the
        earlier turns (previous_response_id), replayed before this request's input;
        `takes_images`: the served model takes images (`input_image` parts)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        messages += items_to_messages(history + self.input_items(), len(history), takes_images)
        if not messages:
            raise refuse("`input` is empty: send a string or at least one item.", "input")
        body: dict[str, Any] = dict(
            model=self.model, messages=messages, temperature=self.temperature, top_p=self.top_p,
            max_completion_tokens=self.max_output_tokens, user=self.user,
            stream=bool(self.stream), parallel_tool_calls=self.parallel_tool_calls)
        tools = chat_tools(self.tools)
        if tools:
            body["tools"] = tools
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        fmt = response_format(self.text)
        if fmt is not None:
            body["response_format"] = fmt
        extra = self.model_extra or {}
        body.update({k: extra[k] for k in PASSTHROUGH_FIELDS if k in extra})
        effort = (self.reasoning or {}).get("effort")
        kwargs = body.get("chat_template_kwargs")
        if effort is not None and isinstance(kwargs, (dict, type(None))):
            # the template variable vLLM passes too (gpt-oss's template reads it)
            body["chat_template_kwargs"] = {**(kwargs or {}), "reasoning_effort": effort}
        try:
            return ChatCompletionRequest(**body)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(x) for x in err.get("loc", ()))
            msg = str(err.get("msg", ""))
            param = {"max_completion_tokens": "max_output_tokens",
                     "response_format": "text.format"}.get(loc.split(".")[0], loc or None)
            if param is None and "tool_choice" in msg:  # chat's cross-field check
                param = "tool_choice"
            raise refuse(f"{param or 'body'}: {err.get('msg', 'invalid value')}",
                         param) from None


def _image_part(part: dict[str, Any], where: str, takes_images: bool) -> dict[str, Any]:
    """An `input_image` part as chat's `image_url` part (chat loads and checks the image)."""
    if not takes_images:
        raise refuse(f"`{where}`: content part type 'input_image' is not supported: this model "
                     "takes no images (text parts only: input_text, output_text).",
                     f"{where}.type")
    if part.get("file_id") is not None:
        raise refuse(f"`{where}.file_id`: file ids are not supported (there is no Files API "
                     "here); send the image as `image_url` (a data URL or an allowed http(s) "
                     "URL).", f"{where}.file_id")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise refuse(f"`{where}.image_url` is required (a data URL or an http(s) URL).",
                     f"{where}.image_url")
    spec = {"url": url}
    if part.get("detail") is not None:
        spec["detail"] = part["detail"]
    return {"type": "image_url", "image_url": spec}


def _content_of(content: Any, where: str,
                takes_images: bool | None = False) -> str | list[dict]:
    """An item's `content` for chat: its text (text parts joined by newlines), or, when it
    holds images, chat's parts in their order. `takes_images`: whether the model takes images
    (False: an image part is refused as such); None where no image may be (an assistant's
    message, a tool's output)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise refuse(f"`{where}.content` must be a string or a list of parts.", f"{where}.content")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        elif kind == "input_image" and takes_images is not None:
            parts.append(_image_part(part, f"{where}.content[{j}]", takes_images))
        else:
            raise refuse(f"`{where}.content[{j}]`: content part type {kind!r} is not supported "
                         "by /v1/responses (text parts, and input_image for a model that takes "
                         "images).", f"{where}.content[{j}].type")
    if any(p["type"] == "image_url" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def items_to_messages(items: list[dict[str, Any]], n_history: int = 0,
                      takes_images: bool = False) -> list[dict[str, Any]]:
    """Chat messages (ChatMessageParam's dict form) of Responses input items; `n_history`:
    how many leading items came from earlier turns (an error names this request's index);
    `takes_images`: the model takes images (input_image parts of non-assistant messages)."""
    messages: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        where = f"input[{i - n_history}]" if i >= n_history else "previous_response_id"
        if not isinstance(item, dict):
            raise refuse(f"`{where}` must be an object.", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise refuse(f"`{where}.role` must be user, system, developer or assistant, "
                             f"got {role!r}.", f"{where}.role")
            images = takes_images if role != "assistant" else None  # None: no image part
            messages.append({"role": role,
                             "content": _content_of(item.get("content"), where, images)})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise refuse(f"`{where}`: a function_call item needs `call_id` and `name`.",
                             f"{where}.call_id")
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            call_ids.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in call_ids:
                raise refuse(f"`{where}.call_id`: no earlier function_call has call_id "
                             f"{call_id!r}.", f"{where}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _content_of(
                output, f"{where}.output", None)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue  # earlier turns' reasoning: not shown to the template (as in chat)
        else:
            raise refuse(f"`{where}.type`: input item type {kind!r} is not supported (message, "
                         "function_call, function_call_output, reasoning).", f"{where}.type")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Responses' flat function tools as chat's `{"type", "function": {...}}` (`strict` kept: the
    chat plan enforces it under any tool_choice)."""
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind != "function":
            raise refuse(f"`tools[{i}].type`: tool type {kind!r} is not supported; this server "
                         "runs no hosted tools (function tools only).", f"tools[{i}].type")
        if not isinstance(tool.get("name"), str):
            raise refuse(f"`tools[{i}].name` is required.", f"tools[{i}].name")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise refuse(f"`tool_choice` {choice!r} is not supported: 'none', 'auto', 'required' or "
                 '{"type": "function", "name": ...}.', "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`; `text.verbosity` is refused."""
    if not text:
        return None
    for key, value in text.items():
        if key != "format" and value is not None:
            raise refuse(f"`text.{key}` is not supported (only `text.format`).", f"text.{key}")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise refuse("`text.format.schema` is required with type 'json_schema'.",
                         "text.format.schema")
        return {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    raise refuse(f"`text.format.type` {kind!r} is not supported (text, json_object, "
                 "json_schema).", "text.format.type")

