"""Offline and served engines give every sampling edge case the same answer (issue 23).

Each case of tests/boundary_cases.py's table goes through `LLM(...).generate(prompt,
SamplingParams(**kwargs))` (a ValueError from either = refused) and through POST
/v1/completions of a real `pagedllm serve` (engine core in its own process) with the same fields
(a 4xx = refused, a 200 = accepted), both on the default model with max_model_len 512 and
max_num_seqs 8. The two answers must agree, and match the table's (vLLM's) where it gives one.
Any other outcome is a defect of its own: an exception other than ValueError offline, a 5xx or
no answer from the server, or either engine unable to serve a plain request afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from unittest import mock

import httpx
import pytest

from pagedllm import LLM, SamplingParams
from tests.boundary_cases import (ACCEPT, ENGINE, REFUSE, SAMPLING_CASES, SERVE_ARGS, VOCAB_SIZE,
                                  SamplingCase)
from tests.server.conftest import serving

pytestmark = pytest.mark.slow

REQUEST_TIMEOUT_S = 30.0
PLAIN_PARAMS = dict(max_tokens=2)


@dataclass
class Outcome:
    kind: str  # ACCEPT, REFUSE, or "error" (neither: a defect)
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} ({self.detail[:300]})"


class Offline:
    """The offline engine; rebuilt when a case left it unable to serve."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.llm = self._build()

    def _build(self) -> LLM:
        llm = LLM(self.model, **ENGINE)
        assert llm.llm_engine.inputs.vocab_size == VOCAB_SIZE
        return llm

    def answer(self, case: SamplingCase) -> Outcome:
        try:
            params = SamplingParams(**case.kwargs)
        except ValueError as exc:
            return Outcome(REFUSE, f"SamplingParams: {exc}")
        except Exception as exc:  # noqa: BLE001 - anything but a ValueError is a defect
            return Outcome("error", f"SamplingParams raised {exc!r}")
        try:
            outs = self.llm.generate(case.offline_prompt, params, use_tqdm=False)
        except ValueError as exc:
            return Outcome(REFUSE, f"generate: {exc}")
        except Exception as exc:  # noqa: BLE001
            return Outcome("error", f"generate raised {exc!r}")
        texts = [c.text for c in outs[0].outputs]
        return Outcome(ACCEPT, f"{len(texts)} output(s): {texts[:2]!r}")

    def check_alive(self) -> str | None:
        """None if a plain generate works; else why (and the engine is rebuilt)."""
        try:
            out = self.llm.generate("Hello", SamplingParams(**PLAIN_PARAMS), use_tqdm=False)
            assert out[0].outputs[0].token_ids
            return None
        except Exception as exc:  # noqa: BLE001
            with contextlib.suppress(Exception):
                self.llm.shutdown()
            self.llm = self._build()
            return f"a plain generate afterwards failed: {exc!r}"


class Served:
    """The server (its engine core in its own process); restarted when a case killed it."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self.start()

    def start(self) -> None:
        stack = contextlib.ExitStack()
        with mock.patch.dict(os.environ):
            os.environ.pop("PAGEDLLM_ENGINE_IN_PROCESS", None)
            self.srv = stack.enter_context(serving(
                ["-m", "pagedllm.entrypoints.cli", "serve", *SERVE_ARGS]))
        self.client = stack.enter_context(httpx.Client(
            base_url=self.srv.url, headers=self.srv.headers,
            timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=5.0)))
        self._stack = stack

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def answer(self, case: SamplingCase) -> Outcome:
        try:
            r = self.client.post("/v1/completions", content=case.http_content(),
                                 headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            return Outcome("error", f"no answer: {type(exc).__name__}: {exc}")
        if r.status_code == 200:
            try:
                texts = [c["text"] for c in r.json()["choices"]]
            except (ValueError, KeyError, TypeError):
                return Outcome("error", f"200 without a completion: {r.text[:300]}")
            return Outcome(ACCEPT, f"200, {len(texts)} choice(s): {texts[:2]!r}")
        if 400 <= r.status_code < 500:
            try:
                err = r.json()["error"]
                return Outcome(REFUSE, f"{r.status_code}: {err['message']}")
            except (ValueError, KeyError, TypeError):
                return Outcome("error", f"{r.status_code} without OpenAI's error body: "
                                        f"{r.text[:300]}")
        return Outcome("error", f"{r.status_code}: {r.text[:400]}")

    def check_alive(self) -> str | None:
        problems = []
        try:
            r = self.client.post("/v1/completions", json={"prompt": "Hello", **PLAIN_PARAMS},
                                 timeout=10.0)
            if r.status_code != 200:
                problems.append(f"a plain request afterwards: {r.status_code} {r.text[:200]}")
            h = self.client.get("/health", timeout=5.0)
            if h.status_code != 200:
                problems.append(f"/health afterwards: {h.status_code} {h.text[:200]}")
        except httpx.HTTPError as exc:
            problems.append(f"the server did not answer afterwards: {exc!r}")
        if not problems:
            return None
        self.stop()
        self.start()
        return "; ".join(problems)


@pytest.fixture(scope="module")
def offline(smollm2_gguf):
    o = Offline(smollm2_gguf)
    yield o
    o.llm.shutdown()


@pytest.fixture(scope="module")
def served():
    s = Served()
    yield s
    s.stop()


def _kwargs_text(case: SamplingCase) -> str:
    text = json.dumps(case.kwargs, allow_nan=True, default=str)
    return text if len(text) < 300 else text[:300] + "..."


@pytest.mark.parametrize("case", SAMPLING_CASES, ids=[c.id for c in SAMPLING_CASES])
def test_offline_and_server_agree(case, offline, served):
    off = offline.answer(case)
    off_after = offline.check_alive()
    srv = served.answer(case)
    srv_after = served.check_alive()
    problems = []
    if off.kind == "error":
        problems.append(f"offline: {off}")
    if srv.kind == "error":
        problems.append(f"server: {srv}")
    if off_after:
        problems.append(f"offline engine broken by the case: {off_after}")
    if srv_after:
        problems.append(f"server broken by the case: {srv_after}")
    if off.kind != srv.kind:
        problems.append(f"they disagree: offline {off.kind}, server {srv.kind}")
    if case.expect is not None:
        for side, o in (("offline", off), ("server", srv)):
            if o.kind != case.expect:
                problems.append(f"{side} must {case.expect}, got {o.kind}")
    prompt = case.prompt if not isinstance(case.prompt, list) or len(case.prompt) < 8 \
        else f"[{case.prompt[0]}] * {len(case.prompt)}"
    assert not problems, (f"{case.id}: prompt={prompt!r} SamplingParams({_kwargs_text(case)})"
                          f"\n  offline: {off}\n  server:  {srv}\n  problems: {problems}")
