"""Encoder-only models (BERT, RoBERTa, XLM-RoBERTa; their `*ForSequenceClassification`
cross-encoders): bidirectional attention, no KV cache. The modules are transformers' own
(a well-kept implementation, so parity is by construction); this file is the batching: each
step takes the oldest waiting request (nothing starves) and fills the batch with the waiting
requests nearest to it in length, so a padded batch wastes little."""

from __future__ import annotations

import collections
from typing import Any

import torch

from pagedllm.model.registry import ENCODER_CLASSIFY_ARCHS
from pagedllm.pooling.poolers import pool
from pagedllm.pooling.work import PoolingWork


class EncoderRunner:
    """add / step / abort over an encoder; `step()` returns (request id, vector): the pooled
    last hidden state (embedding models) or the classifier's logits."""

    def __init__(self, model_path: str, hf_config: Any, arch: str, dtype: torch.dtype, device: torch.device,
                 pooling_type: str, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        from transformers import AutoModel, AutoModelForSequenceClassification

        self.is_classifier = arch in ENCODER_CLASSIFY_ARCHS
        cls = AutoModelForSequenceClassification if self.is_classifier else AutoModel
        self.model = cls.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
        self.device = device
        self.pooling_type = pooling_type
        self.pad_id = int(getattr(hf_config, "pad_token_id", None) or 0)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: collections.OrderedDict[str, PoolingWork] = collections.OrderedDict()

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def add(self, work: PoolingWork) -> None:
        self.waiting[work.request_id] = work

    def abort(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def _pick(self) -> list[PoolingWork]:
        first = next(iter(self.waiting.values()))
        n0 = len(first.token_ids)
        others = sorted((w for w in self.waiting.values() if w is not first),
                        key=lambda w: abs(len(w.token_ids) - n0))
        batch, longest = [first], n0
        for w in others:
            if len(batch) >= self.max_num_seqs:
                break
            m = max(longest, len(w.token_ids))
            if m * (len(batch) + 1) > self.max_num_batched_tokens:
                break
            batch.append(w)
            longest = m
        for w in batch:
            del self.waiting[w.request_id]
        return batch

    @torch.inference_mode()
    def step(self) -> list[tuple[str, torch.Tensor]]:
        if not self.waiting:
            return []
        batch = self._pick()
        longest = max(len(w.token_ids) for w in batch)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, w in enumerate(batch):
            n = len(w.token_ids)
            ids[i, :n] = torch.tensor(w.token_ids)
            if w.token_type_ids is not None:
                types[i, :n] = torch.tensor(w.token_type_ids)
            mask[i, :n] = 1
        kwargs = dict(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        if getattr(self.model.config, "type_vocab_size", 0) > 1:
            kwargs["token_type_ids"] = types.to(self.device)
        out = self.model(**kwargs)
        if self.is_classifier:
            logits = out.logits.float()
            return [(w.request_id, logits[i]) for i, w in enumerate(batch)]
        hidden = out.last_hidden_state
        return [(w.request_id, pool(hidden[i, :len(w.token_ids)], self.pooling_type).float())
                for i, w in enumerate(batch)]
