"""The offline pooling API that `LLM` carries (vLLM's names): `encode`, `embed`, `classify`,
`score`; one batch loop over the `LLMEngine`, whose core runs pooling requests like any other
(engine/core_pooling.py)."""

from __future__ import annotations

import itertools
from typing import Any, Sequence as SequenceT

import torch
from tqdm.auto import tqdm

from pagedllm.engine.engine import LLMEngine
from pagedllm.pooling.inputs import PoolingInputs
from pagedllm.pooling.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling.params import PoolingParams


def _prompt_list(prompts: Any) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts is empty.")
        if all(isinstance(p, int) for p in prompts):
            raise ValueError("A flat list of ints is ambiguous: pass {'prompt_token_ids': [...]} instead.")
        return list(prompts)
    raise ValueError(f"prompts must be a string, a dict or a list, got {type(prompts).__name__}.")


def _with_task(params: PoolingParams | None, task: str, truncate: int | None) -> PoolingParams:
    if params is not None and not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}.")
    params = (params or PoolingParams()).clone(task=task)
    if truncate is not None:
        params.truncate_prompt_tokens = truncate
    params.validate()
    return params


class PoolingAPI:
    """Mixed into `LLM`; a pooling model's engine has `pooling_inputs` (its prompt rule)."""

    llm_engine: LLMEngine
    _pool_counter = itertools.count()

    def _pooling(self) -> PoolingInputs:
        inputs = self.llm_engine.pooling_inputs
        if inputs is None:
            raise ValueError("This model runs as a generation model: embed / classify / score / encode need a "
                             "pooling model (LLM(model, runner='pooling')).")
        return inputs

    def encode(self, prompts: Any, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None, pooling_task: str = "encode") -> list[PoolingRequestOutput]:
        """The pooled vector of every prompt (`.outputs.data`), in the order of the prompts."""
        params = _with_task(pooling_params, pooling_task, truncate_prompt_tokens)
        return self._run_pooling([(p, None) for p in _prompt_list(prompts)], params, use_tqdm)

    def embed(self, prompts: Any, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        outs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: Any, pooling_params: PoolingParams | None = None, use_tqdm: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        outs = self.encode(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: str | SequenceT[str], data_2: str | SequenceT[str], use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """Scores of (data_1[i], data_2[i]) pairs; one data_1 is paired with every data_2. A
        cross-encoder reads each pair together; an embedding model scores the cosine
        similarity of the two embeddings."""
        engine = self._pooling()
        engine.check_task("score")
        q = [data_1] if isinstance(data_1, str) else list(data_1)
        d = [data_2] if isinstance(data_2, str) else list(data_2)
        if not q or not d:
            raise ValueError("score() needs at least one text on each side.")
        if len(q) == 1:
            q = q * len(d)
        if len(q) != len(d):
            raise ValueError(f"score() pairs data_1 and data_2 one to one: got {len(q)} and {len(d)} texts.")
        for text in q + d:
            if not isinstance(text, str):
                raise ValueError(f"score() takes strings, got {type(text).__name__}.")
        params = _with_task(pooling_params, "score", truncate_prompt_tokens)
        if engine.is_classifier:
            outs = self._run_pooling(list(zip(q, d)), params, use_tqdm)
        else:
            unique = list(dict.fromkeys(q + d))
            embs = self._run_pooling([(t, None) for t in unique], params.clone(normalize=True, task="embed"),
                                     use_tqdm)
            by_text = {t: o for t, o in zip(unique, embs)}
            outs = []
            for a, b in zip(q, d):
                ea, eb = by_text[a], by_text[b]
                cos = torch.nn.functional.cosine_similarity(ea.outputs.data, eb.outputs.data, dim=0)
                outs.append(PoolingRequestOutput(ea.request_id + "+" + eb.request_id, PoolingOutput(cos.reshape(1)),
                                                 ea.prompt_token_ids + eb.prompt_token_ids))
        return [ScoringRequestOutput.from_base(o) for o in outs]

    def _run_pooling(self, items: list[tuple[Any, str | None]], params: PoolingParams,
                     use_tqdm: bool) -> list[PoolingRequestOutput]:
        inputs = self._pooling()
        engine = self.llm_engine
        ids = [f"pool-{next(self._pool_counter)}" for _ in items]
        pairs = [pair for _, pair in items]
        prepared = inputs.prepare_many(ids, [prompt for prompt, _ in items], params,
                                       pairs if any(p is not None for p in pairs) else None)
        try:
            for p, work in prepared:
                engine.add_pooling_request(p, work)
        except BaseException:
            engine.abort_request(ids)  # nothing half-submitted stays in the engine
            raise
        results: dict[str, PoolingRequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    results[out.request_id] = out
                    bar.update(1)
                if not engine.has_unfinished_requests() and len(results) < len(ids):
                    raise RuntimeError("The engine stopped with pooling requests unfinished.")
        except BaseException:
            engine.abort_request([r for r in ids if r not in results])
            raise
        finally:
            bar.close()
        return [results[r] for r in ids]
