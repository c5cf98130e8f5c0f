"""What every endpoint shares: the engine, the served model's name, and a tokenizer of the
server's own.

The server renders chat templates, tokenizes prompts and decodes token ids on a tokenizer
*copy* in a single worker thread: the event loop never does that CPU work, the engine thread's
tokenizer is never used from two threads at once, and prompts reach the engine already
tokenized (the engine core only schedules and runs the model; the event loop detokenizes its
token deltas with the engine's tokenizer, `AsyncLLMEngine.output_processor`).
"""

from __future__ import annotations

import asyncio
import copy
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from fastapi import Request

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.tool_calling import ToolConfig
from pagedllm.multimodal.chat_parts import ImageRef, load_images
from pagedllm.multimodal.media import MediaPolicy
from pagedllm.tokenizer import apply_chat_template

T = TypeVar("T")
# Threads that fetch and decode images: requests' images load side by side, a slow URL holding
# one thread for at most --media-fetch-timeout.
MEDIA_THREADS = 16


@dataclass
class ServerOptions:
    """The server flags the endpoints read (arg_utils.add_server_args)."""

    log_requests: bool = False  # --enable-log-requests
    max_log_len: int | None = None  # --max-log-len
    enable_prompt_tokens_details: bool = False  # --enable-prompt-tokens-details
    # /v1/responses' store (response_store.py): --disable-responses-store and its bounds
    responses_store: bool = True
    responses_store_max_entries: int = 10_000
    responses_store_max_bytes: int = 256 * 1024 * 1024


class ServingContext:
    def __init__(self, async_engine: AsyncLLMEngine, chat_template: str | None = None,
                 tool_config: ToolConfig | None = None) -> None:
        info = async_engine.info
        # --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser
        self.async_engine = async_engine
        self.model_name: str = info.model_name  # the reported name (the first served one)
        # every name requests may use (--served-model-name A B ...)
        self.model_names: list[str] = list(getattr(info, "served_model_names", None) or
                                           [info.model_name])
        # generation_config.json's sampling defaults (--generation-config)
        self.generation_defaults: dict[str, Any] = dict(
            getattr(info, "generation_defaults", None) or {})
        self.options = ServerOptions()
        # LoRA adapters served as models (entrypoints/openai/lora_models.py); None: LoRA off
        self.loras: Any = None
        self.lora_modules: list[Any] = []  # --lora-modules, loaded when the server starts
        self.model_root: str = info.model_root
        self.max_model_len: int = info.max_model_len
        self.vocab_size: int = info.vocab_size
        self.chat_template = chat_template or info.chat_template
        # the tool-call format "auto" reads: the flag's, or the one the chat template speaks
        self.tool_config = (tool_config or ToolConfig()).for_template(self.chat_template)
        # A copy: the event loop's output processor decodes with the engine's own.
        self.tokenizer = copy.deepcopy(async_engine.tokenizer)
        self._tok_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-tok")
        # image inputs (docs/multimodal.md): what the model takes, how many, from where
        self.takes_images: bool = bool(getattr(info, "takes_images", False))
        self.limit_mm_per_prompt: dict[str, int] = dict(getattr(info, "limit_mm_per_prompt", None) or {})
        self.media_policy: MediaPolicy = getattr(info, "media_policy", None) or MediaPolicy()
        self._media_executor: ThreadPoolExecutor | None = None

    def close(self) -> None:
        self._tok_executor.shutdown(wait=False, cancel_futures=True)
        if self._media_executor is not None:
            self._media_executor.shutdown(wait=False, cancel_futures=True)

    async def load_images(self, refs: list[ImageRef]) -> list[Any]:
        """A request's images, loaded (fetched, decoded, RGB) on the media threads, each on its
        own, in order: never on the event loop, and never in the tokenizer thread, where a
        slow URL (up to --media-fetch-timeout) would hold every other request's rendering."""
        if self._media_executor is None:
            self._media_executor = ThreadPoolExecutor(max_workers=MEDIA_THREADS,
                                                      thread_name_prefix="pagedllm-media")
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self._media_executor, load_images, [ref], self.media_policy)
                   for ref in refs]
        loaded = await asyncio.gather(*futures, return_exceptions=True)
        for item in loaded:  # the first failure in prompt order; the others are dropped
            if isinstance(item, BaseException):
                raise item
        return [item[0] for item in loaded]

    async def run_tokenizer(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` (which uses `self.tokenizer`) in the tokenizer thread."""
        loop = asyncio.get_running_loop()
        call = functools.partial(fn, *args, **kwargs)
        return await loop.run_in_executor(self._tok_executor, call)

    def check_model(self, model: str | None) -> Any:
        """The LoRA adapter (lora/request.LoRARequest) a request's `model` names, None for the
        base model; a 404 for a name this server does not serve."""
        if self.loras is not None:
            return self.loras.resolve(model)
        if model is not None and model not in self.model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, param="model")
        return None

    def served_name(self, model: str | None) -> str:
        """The `model` a response reports: the adapter's name for an adapter's request."""
        if self.loras is not None and model in self.loras.by_name:
            return model
        return self.model_name

    # ---- tokenizer work (runs in the tokenizer thread) ------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]

    def check_token_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(
                f"Token id(s) {bad[:8]} are out of vocabulary (size {self.vocab_size}).", 400
            )

    def render_chat(
        self,
        conversation: list[dict[str, Any]],
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        try:
            return apply_chat_template(
                self.tokenizer, conversation,
                chat_template=chat_template or self.chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                **(template_kwargs or {}),
            )
        except ValueError:
            raise
        except Exception as exc:  # a template that fails to render is the request's problem
            raise OpenAIError(f"Could not apply the chat template: {exc}", 400) from exc


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler):
    """Run the endpoint as a task and cancel it when the client disconnects first.

    FastAPI has read the body before the handler runs, so the next message on the connection
    is `http.disconnect`. Cancelling the handler cancels the engine request it is waiting on
    (AsyncLLMEngine.generate aborts it). Streaming responses return at once; their own
    disconnect handling is in the response (see streaming.py)."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any):
        request: Request = kwargs["raw_request"]
        handler_task = asyncio.ensure_future(handler(*args, **kwargs))
        disconnect_task = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait([handler_task, disconnect_task],
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect_task.cancel()
            if not handler_task.done():
                handler_task.cancel()
        if handler_task in done:
            return handler_task.result()
        # Let the handler's cleanup (the abort) run before returning.
        await asyncio.gather(handler_task, return_exceptions=True)
        return None  # nobody is listening any more

    return wrapper
