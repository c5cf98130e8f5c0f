"""POST /tokenize and POST /detokenize (vLLM's extra endpoints).

/tokenize takes a `prompt` (tokenized as /v1/completions does, special tokens added by
default) or chat `messages` (rendered with the chat template as /v1/chat/completions does, no
special tokens added on top; a request's own `chat_template` follows chat's rule, chat.py
`RequestTemplates`); it answers `{count, max_model_len, tokens, token_strs}`.
/detokenize takes `tokens` and answers `{prompt}`.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.chat import RequestTemplates
from pagedllm.entrypoints.openai.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving import ServingContext


class TokenizationServer:
    def __init__(self, ctx: ServingContext, templates: RequestTemplates | None = None) -> None:
        self.ctx = ctx
        self.templates = templates or RequestTemplates()

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.ctx.check_model(request.model)
        template, kwargs = self.templates.resolve(request.chat_template,
                                                  request.chat_template_kwargs)
        if request.messages is not None:
            conversation = [m.template_message() for m in request.messages]
        else:
            conversation = None
        return await self.ctx.run_tokenizer(self._tokenize, request, conversation, template,
                                            kwargs)

    def _tokenize(self, request: TokenizeRequest, conversation, template: str | None,
                  kwargs: dict[str, Any]) -> TokenizeResponse:
        ctx = self.ctx
        if conversation is not None:
            text = self.templates.render(ctx, conversation, template, kwargs, request)
            add_special = bool(request.add_special_tokens)
        else:
            text = request.prompt or ""
            add_special = request.add_special_tokens is not False
        ids = ctx.encode(text, add_special_tokens=add_special)
        strs = ctx.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids,
                                token_strs=strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.ctx.check_model(request.model)
        return await self.ctx.run_tokenizer(self._detokenize, request)

    def _detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.ctx.check_token_ids(request.tokens)
        return DetokenizeResponse(prompt=self.ctx.decode(request.tokens))
