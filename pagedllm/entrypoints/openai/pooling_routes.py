"""The pooling endpoints (docs/pooling.md): POST /v1/embeddings (OpenAI), /pooling,
/classify, /score and /v1/score, /rerank, /v1/rerank and /v2/rerank (Jina / Cohere), served
by the one `AsyncLLMEngine` (a pooling request is a request of its engine core); and the refusals by name: a pooling model refuses the generation
endpoints, a generation model the pooling ones (OpenAI-style 400s)."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.pooling_protocol import (
    MAX_INPUTS,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    Usage,
)
from pagedllm.entrypoints.openai.protocol_base import random_uuid
from pagedllm.entrypoints.openai.serving import with_cancellation
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.pooling.inputs import PromptError
from pagedllm.pooling.params import PoolingParams

POOLING_ENDPOINTS = ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                     "/v1/rerank", "/v2/rerank")
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize")
SCORE_ENDPOINTS = ("/score", "/v1/score")
RERANK_ENDPOINTS = ("/rerank", "/v1/rerank", "/v2/rerank")


def _refusal(message: str):
    async def refuse() -> None:
        raise OpenAIError(message, 400)
    return refuse


def add_generation_model_refusals(app: FastAPI, model_name: str) -> None:
    """A generation model's server: every pooling endpoint is a 400 naming it."""
    for path in POOLING_ENDPOINTS:
        app.add_api_route(path, _refusal(
            f"The model {model_name!r} is a generation model: {path} needs a pooling model (an embedding or "
            "cross-encoder model, or `pagedllm serve MODEL --runner pooling`)."), methods=["POST"])


def _params(request: Any, task: str, **extra: Any) -> PoolingParams:
    """The request's PoolingParams; a bad value is a 400 naming its field."""
    fields = {"truncate_prompt_tokens": request.truncate_prompt_tokens, **extra}
    try:
        return PoolingParams(task=task, **fields)
    except ValueError as exc:
        name = next((f for f in fields if str(exc).startswith(f)), None)
        raise OpenAIError(str(exc), 400, name) from None


class PoolingRoutes:
    def __init__(self, engine: AsyncLLMEngine, model_names: list[str]) -> None:
        if engine.pooling_inputs is None:
            raise ValueError("the pooling endpoints need a pooling model's engine")
        self.engine = engine
        self.inputs = engine.pooling_inputs
        self.model_names = model_names

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "model")

    def _check_task(self, task: str) -> None:
        try:
            self.inputs.check_task(task)
        except ValueError as exc:
            raise OpenAIError(str(exc), 400) from None

    def _prepare(self, prefix: str, prompts: list[Any], params: PoolingParams, pairs: list[str | None] | None = None,
                 field: str = "input") -> list[tuple[PoolingParams, Any]]:
        """Validate and tokenize every input before any runs: one bad input fails the
        request (400 naming it) and nothing of it reaches the engine."""
        if not prompts:
            raise OpenAIError(f"{field} must not be empty.", 400, field)
        if len(prompts) > MAX_INPUTS:
            raise OpenAIError(f"{field} has {len(prompts)} items; at most {MAX_INPUTS} per request.", 400, field)
        base = f"{prefix}-{random_uuid()}"
        try:
            return self.inputs.prepare_many([f"{base}-{i}" for i in range(len(prompts))], prompts, params,
                                                   pairs)
        except PromptError as exc:
            where = field if len(prompts) == 1 else f"{field}[{exc.index}]"
            raise OpenAIError(f"{where}: {exc}", 400, field) from None
        except ValueError as exc:
            message = str(exc)
            name = next((f for f in ("dimensions", "truncate_prompt_tokens", "normalize") if message.startswith(f)),
                        field)
            raise OpenAIError(message, 400, name) from None

    async def _run(self, prepared: list[tuple[PoolingParams, Any]]) -> list:
        tasks = [asyncio.ensure_future(self.engine.pool(p, w)) for p, w in prepared]
        try:
            return await asyncio.gather(*tasks)
        except EngineDeadError as exc:
            raise OpenAIError(str(exc), 503) from None
        finally:
            for t in tasks:  # a failure or a client gone: the rest are aborted
                if not t.done():
                    t.cancel()

    # ---- embeddings and pooling -----------------------------------------------------------

    @staticmethod
    def _inputs(value: Any) -> list[Any]:
        if isinstance(value, str):
            return [value]
        if value and all(isinstance(v, int) for v in value):
            return [{"prompt_token_ids": list(value)}]
        return [v if isinstance(v, str) else {"prompt_token_ids": list(v)} for v in value]

    async def _pool(self, request: EmbeddingRequest, task: str) -> tuple[list, int]:
        self._check_model(request.model)
        self._check_task(task)
        params = _params(request, task, dimensions=request.dimensions, normalize=request.normalize)
        outs = await self._run(self._prepare("embd", self._inputs(request.input), params))
        return outs, sum(len(o.prompt_token_ids) for o in outs)

    @staticmethod
    def _encode(vec: torch.Tensor, fmt: str) -> list[float] | str:
        if fmt == "base64":
            return base64.b64encode(vec.numpy().astype(np.float32).tobytes()).decode()
        return vec.tolist()

    async def embeddings(self, request: EmbeddingRequest) -> dict:
        outs, n = await self._pool(request, "embed")
        data = [EmbeddingData(index=i, embedding=self._encode(o.outputs.data, request.encoding_format))
                for i, o in enumerate(outs)]
        return EmbeddingResponse(model=self.model_name, data=data,
                                 usage=Usage(prompt_tokens=n, total_tokens=n)).model_dump()

    async def pooling(self, request: PoolingRequest) -> dict:
        outs, n = await self._pool(request, "encode")
        data = [PoolingData(index=i, data=self._encode(o.outputs.data, request.encoding_format))
                for i, o in enumerate(outs)]
        return PoolingResponse(model=self.model_name, data=data,
                               usage=Usage(prompt_tokens=n, total_tokens=n)).model_dump()

    # ---- classification, scores, rerank ---------------------------------------------------

    async def classify(self, request: ClassificationRequest) -> dict:
        self._check_model(request.model)
        self._check_task("classify")
        params = _params(request, "classify")
        inputs = [request.input] if isinstance(request.input, str) else list(request.input)
        outs = await self._run(self._prepare("classify", inputs, params))
        id2label = getattr(self.inputs.hf_config, "id2label", None) or {}
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.tolist()
            best = int(torch.argmax(o.outputs.data)) if len(probs) > 1 else 0
            data.append(ClassificationData(index=i, label=id2label.get(best, str(best)), probs=probs,
                                           num_classes=len(probs)))
        n = sum(len(o.prompt_token_ids) for o in outs)
        return ClassificationResponse(model=self.model_name, data=data,
                                      usage=Usage(prompt_tokens=n, total_tokens=n)).model_dump()

    async def _scores(self, request: Any, queries: list[str], docs: list[str], q_field: str,
                      d_field: str) -> tuple[list[float], int]:
        """Scores of the (query, document) pairs: a cross-encoder reads each pair; an
        embedding model's score is the cosine similarity of the two embeddings."""
        self._check_model(request.model)
        self._check_task("score")
        if not queries:
            raise OpenAIError(f"{q_field} must not be empty.", 400, q_field)
        if not docs:
            raise OpenAIError(f"{d_field} must not be empty.", 400, d_field)
        if len(queries) == 1:
            queries = queries * len(docs)
        if len(queries) != len(docs):
            raise OpenAIError(f"{q_field} and {d_field} pair one to one: got {len(queries)} and {len(docs)}.",
                              400, q_field)
        params = _params(request, "score")
        if self.inputs.is_classifier:
            outs = await self._run(self._prepare("score", queries, params, pairs=docs, field=d_field))
            return [float(o.outputs.data.reshape(-1)[0]) for o in outs], sum(len(o.prompt_token_ids) for o in outs)
        unique = list(dict.fromkeys(queries + docs))
        outs = await self._run(self._prepare("score", unique, params.clone(normalize=True, task="embed"),
                                             field=d_field))
        vec = {t: o.outputs.data for t, o in zip(unique, outs)}
        scores = [float(torch.dot(vec[q], vec[d])) for q, d in zip(queries, docs)]
        return scores, sum(len(o.prompt_token_ids) for o in outs)

    async def score(self, request: ScoreRequest) -> dict:
        q = [request.text_1] if isinstance(request.text_1, str) else list(request.text_1)
        d = [request.text_2] if isinstance(request.text_2, str) else list(request.text_2)
        scores, n = await self._scores(request, q, d, "text_1", "text_2")
        return ScoreResponse(model=self.model_name, data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=Usage(prompt_tokens=n, total_tokens=n)).model_dump()

    async def rerank(self, request: RerankRequest) -> dict:
        if request.top_n is not None and request.top_n < 0:
            raise OpenAIError(f"top_n must be at least 0, got {request.top_n}.", 400, "top_n")
        docs = [d if isinstance(d, str) else d.text for d in request.documents]
        scores, n = await self._scores(request, [request.query], docs, "query", "documents")
        order = sorted(range(len(docs)), key=lambda i: -scores[i])
        if request.top_n:
            order = order[:request.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document={"text": docs[i]} if request.return_documents else None)
                   for i in order]
        return RerankResponse(model=self.model_name, usage={"prompt_tokens": n, "total_tokens": n},
                              results=results).model_dump(exclude_none=True)

    # ---- wiring ---------------------------------------------------------------------------

    def install(self, app: FastAPI) -> None:
        """The pooling endpoints, and the generation ones refused by name."""

        @app.post("/v1/embeddings")
        @with_cancellation
        async def embeddings(request: EmbeddingRequest, raw_request: Request) -> dict:
            return await self.embeddings(request)

        @app.post("/pooling")
        @with_cancellation
        async def pooling(request: PoolingRequest, raw_request: Request) -> dict:
            return await self.pooling(request)

        @app.post("/classify")
        @with_cancellation
        async def classify(request: ClassificationRequest, raw_request: Request) -> dict:
            return await self.classify(request)

        for path in SCORE_ENDPOINTS:
            @with_cancellation
            async def score(request: ScoreRequest, raw_request: Request) -> dict:
                return await self.score(request)
            app.add_api_route(path, score, methods=["POST"])

        for path in RERANK_ENDPOINTS:
            @with_cancellation
            async def rerank(request: RerankRequest, raw_request: Request) -> dict:
                return await self.rerank(request)
            app.add_api_route(path, rerank, methods=["POST"])

        for path in GENERATION_ENDPOINTS:
            app.add_api_route(path, _refusal(
                f"The model {self.model_name!r} is a pooling model (embeddings / classification / scores): "
                f"{path} needs a generation model."), methods=["POST"])
