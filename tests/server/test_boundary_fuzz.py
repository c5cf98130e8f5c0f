"""A boundary fuzzer for the OpenAI server (issue 23: "one request, one fault: never the whole
server").

Generated /v1/completions, /v1/chat/completions and /v1/responses bodies (hypothesis; field
names and types also drawn from the server's own /openapi.json) go to a real `pagedllm serve` on
the default model, its engine core in its own process, `--max-model-len 512 --max-num-seqs 8`. Every case
must be answered within CASE_TIMEOUT_S by a 200 (a JSON completion, or an SSE stream that ends
with `[DONE]` and carries no 5xx error event; for /v1/responses a response object, or a typed
event stream that ends with response.completed / .incomplete / .failed, never a server_error) or by a 4xx whose body is OpenAI's error JSON
(`{"error": {"message", "type", "param", "code"}}`, code = the status); never a 5xx, never a
hang. After each case a plain completion must succeed within ALIVE_TIMEOUT_S, GET /health
must be 200 and the engine must come back to idle (nothing running or waiting, no KV block
held). A quarter of the cases run while a plain streamed request is decoding (it must still
get all its tokens: one request's fault stays its own), and a quarter of the streamed ones
close the connection after the first event (the request must be aborted). Where a body breaks
one of vLLM's rules that need no model to decide (n or best_of past max_num_seqs, a seed
outside [-2**63, 2**64-1], min_tokens > max_tokens, logprobs past --max-logprobs, an
out-of-vocabulary id, ...: `must_refuse`), a 4xx is required. Half the cases combine values
that are accepted one by one with a single edge value, so that edge values reach the engine and
not only validation; accepted cases generate at most a few tokens.

The fuzzer does not stop at the first failure: it runs all its cases, restarts the server when a
case killed or hung it, reduces each distinct failure to a smaller body (top-level fields
dropped while it still fails the same way) and fails once at the end with the list. Set
PAGEDLLM_FUZZ_REPORT=<path> to also get that list as JSON, PAGEDLLM_FUZZ_EXAMPLES=<n> to change
the number of generated cases (default 200, about 1.5 minutes on two cores here and up to
4 on CI's machines; 500 or more for a deeper run before a release; the run is derandomized, so
CI sees the same cases every time), PAGEDLLM_FUZZ_SEED=<int> to explore other cases.

FIXED_CASES are the reproductions that must always run (issue 23's list, and what this fuzzer
found), with the answer each must get.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from tests.boundary_cases import (MAX_LOGPROBS, MAX_MODEL_LEN, MAX_NUM_SEQS, SEED_MAX, SEED_MIN,
                                  SERVE_ARGS, VOCAB_SIZE)
from tests.server.conftest import serving
from tests.server.helpers import MODEL, metric, read_metrics

pytestmark = pytest.mark.slow

CASE_TIMEOUT_S = 30.0
ALIVE_TIMEOUT_S = 10.0
N_EXAMPLES = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", "200"))
# another (fixed) seed for exploring beyond CI's cases; unset: derandomized
SEED = os.environ.get("PAGEDLLM_FUZZ_SEED")
MAX_RESTARTS = 6  # server deaths tolerated before the run stops early (each costs ~25 s)
MINIMIZE_BUDGET_S = 90.0  # total time spent reducing failures to smaller bodies
REPORT_PATH = os.environ.get("PAGEDLLM_FUZZ_REPORT")

COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")
PLAIN = {"prompt": "Hello", "max_tokens": 2}
NAN, INF = math.nan, math.inf
ENGINE_PID_RE = re.compile(r"Engine core \d+ ready in [\d.]+ s \(pid (\d+)\)")


# ------------------------------------------------------------------------------- the server


class FuzzServer:
    """`pagedllm serve` with the engine core in its own process; restarted when a case killed
    or hung it."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self.srv = None
        self.client: httpx.Client | None = None
        self.restarts = 0
        self.last_log_tail = ""

    def start(self) -> None:
        stack = contextlib.ExitStack()
        # The core must run in its own process (the default): that is where a fatal error of
        # one request used to take the whole server down.
        with mock.patch.dict(os.environ):
            os.environ.pop("PAGEDLLM_ENGINE_IN_PROCESS", None)
            self.srv = stack.enter_context(serving(
                ["-m", "pagedllm.entrypoints.cli", "serve", *SERVE_ARGS]))
        self.client = stack.enter_context(httpx.Client(
            base_url=self.srv.url, headers=self.srv.headers,
            timeout=httpx.Timeout(CASE_TIMEOUT_S, connect=5.0)))
        self._stack = stack
        pids = [int(p) for p in ENGINE_PID_RE.findall(self.srv.log_tail(1 << 20))]
        assert pids and all(p != self.srv.proc.pid for p in pids), (
            "the engine core must run in its own process:\n" + self.srv.log_tail())

    def stop(self) -> None:
        if self._stack is not None:
            try:
                self.last_log_tail = self.srv.log_tail(6000)
            except OSError:
                pass
            self._stack.close()
            self._stack = None

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    @property
    def url(self) -> str:
        return self.srv.url

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.srv.log_tail(n)
        except OSError:
            return self.last_log_tail[-n:]


@pytest.fixture(scope="module")
def fuzz_server():
    s = FuzzServer()
    s.start()
    try:
        yield s
    finally:
        s.stop()


# ------------------------------------------------------------------------------ one exchange


@dataclass
class Answer:
    status: int | None = None  # None: no answer (timeout or connection error)
    error: str | None = None  # why there is no answer
    body: Any = None  # the JSON body, or the list of SSE events
    text: str = ""
    seconds: float = 0.0
    stream: bool = False
    disconnected: bool = False  # the client closed the stream after its first event

    def excerpt(self, n: int = 400) -> str:
        if self.status is None:
            return f"no answer: {self.error}"
        return f"{self.status} {self.text[:n]}"


def send(client: httpx.Client, path: str, body: Any = None, raw: bytes | None = None,
         timeout: float = CASE_TIMEOUT_S, disconnect: bool = False) -> Answer:
    """POST the case; an SSE answer is read to its end (within the same deadline), or, with
    `disconnect`, up to its first event, and then the connection is closed."""
    content = raw if raw is not None else json.dumps(body, allow_nan=True).encode()
    t0 = time.monotonic()
    deadline = t0 + timeout
    ans = Answer()
    try:
        with client.stream("POST", path, content=content,
                           headers={"content-type": "application/json"},
                           timeout=httpx.Timeout(timeout, connect=5.0)) as r:
            ans.status = r.status_code
            ans.stream = r.headers.get("content-type", "").startswith("text/event-stream")
            chunks = []
            for chunk in r.iter_text():
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout("the stream did not end in time")
                if disconnect and ans.stream and r.status_code == 200 and "data: " in chunk:
                    ans.disconnected = True
                    break
            ans.text = "".join(chunks)
    except (httpx.HTTPError, OSError) as exc:
        ans.status, ans.error = None, f"{type(exc).__name__}: {exc}"
    ans.seconds = time.monotonic() - t0
    if ans.status is not None:
        if ans.stream:
            ans.body = [line[len("data: "):] for line in ans.text.splitlines()
                        if line.startswith("data: ")]
        else:
            try:
                ans.body = json.loads(ans.text)
            except ValueError:
                ans.body = None
    return ans


def _error_shape_problems(body: Any, status: int) -> list[str]:
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return [f"{status} without OpenAI's error body"]
    err = body["error"]
    out = []
    if set(err) != {"message", "type", "param", "code"}:
        out.append(f"error keys {sorted(err)} are not message/type/param/code")
    if not isinstance(err.get("message"), str) or not err.get("message"):
        out.append("error.message is not a non-empty string")
    if not isinstance(err.get("type"), str) or not err.get("type"):
        out.append("error.type is not a non-empty string")
    if err.get("param") is not None and not isinstance(err.get("param"), str):
        out.append("error.param is neither a string nor null")
    if err.get("code") != status:
        out.append(f"error.code {err.get('code')!r} is not the status {status}")
    return out


def responses_answer_problems(ans: Answer) -> list[str]:
    """A 200 of /v1/responses: a response object, or typed events ending the response."""
    if not ans.stream:
        ok = isinstance(ans.body, dict) and ans.body.get("object") == "response"
        return [] if ok else ["a 200 whose body is not a response object"]
    events = []
    for ev in ans.body or []:
        try:
            events.append(json.loads(ev))
        except ValueError:
            if not ans.disconnected:
                return [f"a stream event is not JSON: {ev[:120]!r}"]
    if not events or not all(isinstance(e, dict) for e in events):
        return ["a stream without typed events"]
    if [e.get("sequence_number") for e in events] != list(range(len(events))):
        return ["sequence_number does not count the events from 0"]
    if not ans.disconnected and events[-1].get("type") not in RESPONSE_ENDS:
        return [f"the stream ends with {events[-1].get('type')!r}, not {RESPONSE_ENDS}"]
    failed = [e for e in events if e.get("type") == "response.failed"]
    error = ((failed[0].get("response") or {}).get("error") or {}) if failed else {}
    if error.get("code") == "server_error":
        return [f"response.failed with a server error: {str(error)[:200]}"]
    return []


def answer_problems(ans: Answer, path: str = COMPLETIONS) -> list[str]:
    """What is wrong with the answer itself (never a 5xx, never a hang, well-formed bodies)."""
    if ans.status is None:
        if "Timeout" in (ans.error or ""):
            return [f"no answer within {CASE_TIMEOUT_S:.0f} s ({ans.error})"]
        return [f"no answer ({ans.error})"]
    if ans.status >= 500:
        return [f"{ans.status} (server error)"]
    if ans.status != 200 and not 400 <= ans.status < 500:
        return [f"unexpected status {ans.status}"]
    if ans.status != 200:
        return _error_shape_problems(ans.body, ans.status)
    if path == RESPONSES:
        return responses_answer_problems(ans)
    if ans.stream:
        events = ans.body or []
        if ans.disconnected:
            events = events[:-1]  # the last one may be cut
        elif not events or events[-1] != "[DONE]":
            return ["the stream does not end with [DONE]"]
        for ev in events:
            if ev == "[DONE]":
                continue
            try:
                obj = json.loads(ev)
            except ValueError:
                return [f"a stream event is not JSON: {ev[:120]!r}"]
            if isinstance(obj, dict) and "error" in obj:
                err = obj["error"] if isinstance(obj["error"], dict) else {}
                code = err.get("code")
                if not isinstance(code, int) or code >= 500:
                    return [f"error event {code} inside the stream: {ev[:200]}"]
        return []
    if not isinstance(ans.body, dict) or not isinstance(ans.body.get("choices"), list):
        return ["a 200 whose body is not a completion"]
    return []


def alive_problems(server: FuzzServer) -> tuple[list[str], dict]:
    """After a case: a plain completion within ALIVE_TIMEOUT_S, then /health is 200."""
    info: dict[str, Any] = {}
    plain = send(server.client, COMPLETIONS, PLAIN, timeout=ALIVE_TIMEOUT_S)
    info["plain"] = plain.excerpt(200)
    try:
        h = server.client.get("/health", timeout=5.0)
        info["health"] = f"{h.status_code} {h.text[:200]}"
        health_ok = h.status_code == 200
    except httpx.HTTPError as exc:
        info["health"] = f"no answer: {type(exc).__name__}: {exc}"
        health_ok = False
    out = []
    if plain.status != 200:
        out.append(f"a plain request afterwards failed: {plain.excerpt(160)}")
    if not health_ok:
        out.append(f"/health afterwards: {info['health'][:160]}")
    return out, info


BYSTANDER_TOKENS = 16
BYSTANDER = {"prompt": "Once upon a time", "max_tokens": BYSTANDER_TOKENS, "ignore_eos": True,
             "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


class Bystander(threading.Thread):
    """A plain streamed request in flight while the case is sent: a case's fault must stay
    the case's, not fail the requests batched with it."""

    def __init__(self, server: FuzzServer) -> None:
        super().__init__(daemon=True)
        self.url, self.headers = server.url, server.srv.headers
        self.decoding = threading.Event()  # its first token came: it is in the batch
        self.problem: str | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, headers=self.headers,
                              timeout=httpx.Timeout(CASE_TIMEOUT_S, connect=5.0)) as c, \
                    c.stream("POST", COMPLETIONS, json=BYSTANDER) as r:
                if r.status_code != 200:
                    r.read()
                    self.problem = f"{r.status_code} {r.text[:200]}"
                    return
                events = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        self.decoding.set()
            if not events or events[-1] != "[DONE]":
                self.problem = f"its stream did not end with [DONE]: {events[-2:]}"
                return
            usage = [json.loads(e).get("usage") for e in events[:-1]]
            errors = [e for e in events[:-1] if '"error"' in e]
            if errors:
                self.problem = f"an error event: {errors[0][:200]}"
            elif not usage or not usage[-1] or \
                    usage[-1].get("completion_tokens") != BYSTANDER_TOKENS:
                self.problem = f"not {BYSTANDER_TOKENS} tokens: usage {usage[-1:]}"
        except (httpx.HTTPError, OSError, ValueError) as exc:
            self.problem = f"{type(exc).__name__}: {exc}"
        finally:
            self.decoding.set()


def idle_problems(server: FuzzServer, timeout: float = ALIVE_TIMEOUT_S) -> list[str]:
    """Once every request of the case is done, nothing is left running, waiting or holding
    KV blocks (a refused or aborted request must leave nothing behind)."""
    deadline = time.monotonic() + timeout
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting",
             "pagedllm:num_requests_swapped", "pagedllm:kv_cache_used_blocks")
    while True:
        try:
            m = read_metrics(server.client)
            left = {n.split(":")[1]: metric(m, n) for n in names}
        except (httpx.HTTPError, AssertionError, KeyError) as exc:
            return [f"/metrics unreadable: {exc!r}"[:200]]
        if not any(left.values()):
            return []
        if time.monotonic() > deadline:
            return [f"not idle {timeout:.0f} s after the case: {left}"]
        time.sleep(0.05)


# ------------------------------------------------------------------------- the refusal oracle


def _int(v: Any) -> int | None:
    """The value as an int where it is one (bools and everything else: None, no rule)."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _float(v: Any) -> float | None:
    """The value as the float pydantic makes of it (numbers, numeric strings), else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        try:
            return float(v)
        except OverflowError:
            return INF if v > 0 else -INF
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


_REFUSED_FIELDS = ("prompt_embeds", "logits_processors", "kv_transfer_params", "vllm_xargs",
                   "mm_processor_kwargs", "media_io_kwargs", "documents", "audio", "prediction",
                   "functions", "function_call", "guided_whitespace_pattern")
_STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")


def _bad_token(t: Any) -> bool:
    t = _int(t)
    return t is not None and not 0 <= t < VOCAB_SIZE


def must_refuse(path: str, body: Any) -> list[str]:
    """vLLM's rules a 4xx is certain for, whatever else the body holds (only values of the
    field's own type are judged; a wrong type is left to the invariant)."""
    if not isinstance(body, dict):
        return []
    if path == RESPONSES:
        return must_refuse_responses(body)
    why = []
    get = body.get
    chat = path == CHAT
    n, best_of = _int(get("n")), _int(get("best_of"))
    if n is not None and not 1 <= n <= MAX_NUM_SEQS:
        why.append(f"n={n} outside [1, max_num_seqs={MAX_NUM_SEQS}]")
    if best_of is not None and not 1 <= best_of <= MAX_NUM_SEQS:
        why.append(f"best_of={best_of} outside [1, max_num_seqs={MAX_NUM_SEQS}]")
    if n is not None and best_of is not None and best_of < n:
        why.append("best_of < n")
    seed = _int(get("seed"))
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        why.append(f"seed={seed} outside [-2**63, 2**64-1]")
    top_k = _int(get("top_k"))
    if top_k is not None and top_k < -1:
        why.append("top_k < -1")
    for name, ok in (("temperature", lambda v: 0.0 <= v < INF),
                     ("top_p", lambda v: 0.0 < v <= 1.0),
                     ("min_p", lambda v: 0.0 <= v <= 1.0),
                     ("presence_penalty", lambda v: -2.0 <= v <= 2.0),
                     ("frequency_penalty", lambda v: -2.0 <= v <= 2.0),
                     ("repetition_penalty", lambda v: 0.0 < v < INF),
                     ("length_penalty", math.isfinite)):
        v = _float(get(name))
        if v is not None and not ok(v):
            why.append(f"{name}={v}")
    # log-probabilities: -1 is the whole vocabulary, past --max-logprobs here
    def lp_bad(v: int | None) -> bool:
        return v is not None and (v == -1 or v < -1 or v > MAX_LOGPROBS)

    if chat:
        top = _int(get("top_logprobs"))
        flag = get("logprobs")
        if flag is True and lp_bad(top):
            why.append(f"top_logprobs={top}")
        if flag in (None, False) and top not in (None, 0):
            why.append("top_logprobs without logprobs")
    elif lp_bad(_int(get("logprobs"))):
        why.append(f"logprobs={get('logprobs')}")
    if lp_bad(_int(get("prompt_logprobs"))):
        why.append(f"prompt_logprobs={get('prompt_logprobs')}")
    # max_tokens / min_tokens (512 tokens of context, every prompt has at least one token)
    echo = get("echo") is True and not chat
    if chat:
        raw_max = get("max_completion_tokens")
        raw_max = get("max_tokens") if raw_max is None else raw_max
    else:
        raw_max = get("max_tokens", 16)
    max_tokens = _int(raw_max)
    if max_tokens is not None:
        if max_tokens < 1 and not (echo and max_tokens == 0):
            why.append(f"max_tokens={max_tokens} < 1")
        if max_tokens >= MAX_MODEL_LEN:
            why.append(f"max_tokens={max_tokens} past the context")
    min_tokens = _int(get("min_tokens"))
    if min_tokens is not None:
        if min_tokens < 0:
            why.append("min_tokens < 0")
        if max_tokens is not None and max_tokens >= 1 and min_tokens > max_tokens:
            why.append("min_tokens > max_tokens")
        if raw_max is None and min_tokens >= MAX_MODEL_LEN:
            why.append("min_tokens > the context left (max_tokens unset)")
    # token ids
    lb = get("logit_bias")
    if isinstance(lb, (list, str)) or (lb is not None and not isinstance(lb, dict)):
        why.append("logit_bias is not an object")
    elif isinstance(lb, dict):
        for k, v in lb.items():
            try:
                tid = int(k)
            except ValueError:
                why.append(f"logit_bias key {k!r}")
                break
            if not 0 <= tid < VOCAB_SIZE:
                why.append(f"logit_bias id {tid} out of vocabulary")
                break
            fv = _float(v)
            if v is None or isinstance(v, (list, dict)) or (isinstance(v, str) and fv is None) \
                    or (fv is not None and not math.isfinite(fv)):
                why.append(f"logit_bias value {v!r}")
                break
    stop = get("stop")
    if stop == "" or (isinstance(stop, list) and "" in stop):
        why.append("an empty stop string")
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = get(name)
        if isinstance(ids, list) and any(_bad_token(t) for t in ids):
            why.append(f"{name} out of vocabulary")
    if get("allowed_token_ids") == []:
        why.append("allowed_token_ids empty")
    # the prompt
    if chat:
        if get("messages") == []:
            why.append("no messages")
    else:
        p = get("prompt")
        if p in ("", []) or (isinstance(p, list) and any(x in ("", []) for x in p)):
            why.append("an empty prompt")
        truncated = _int(get("truncate_prompt_tokens")) is not None  # keeps the last k
        if isinstance(p, list) and p and all(_int(x) is not None for x in p):
            if any(_bad_token(x) for x in p):
                why.append("prompt token id out of vocabulary")
            if len(p) >= MAX_MODEL_LEN and not truncated:
                why.append("prompt past the context")
        if isinstance(p, list) and any(isinstance(x, list) and any(_bad_token(t) for t in x)
                                       for x in p):
            why.append("prompt token id out of vocabulary")
        if isinstance(p, str) and p.count("word ") >= MAX_MODEL_LEN and not truncated:
            why.append("prompt past the context")
        if isinstance(get("suffix"), str) and get("suffix"):
            why.append("suffix")
    # other fields
    if isinstance(get("stream_options"), dict) and get("stream") in (None, False):
        why.append("stream_options without stream")
    if chat and get("tool_choice") not in (None, "none") and not get("tools"):
        why.append("tool_choice without tools")
    structured = [k for k in _STRUCTURED if get(k) is not None]
    rf = get("response_format")
    if isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema"):
        structured.append("response_format")
    if len(structured) > 1:
        why.append(f"two structured-output fields {structured}")
    for name in _STRUCTURED + ("response_format",):
        if _marked_invalid(name, get(name)):
            why.append(f"invalid {name}")
    for name in _REFUSED_FIELDS:
        if get(name) is not None:
            why.append(f"refused field {name}")
    priority = _int(get("priority"))
    if priority is not None and priority != 0:
        why.append("priority under fcfs")
    rid = get("request_id")
    if isinstance(rid, str) and not 1 <= len(rid) <= 256:
        why.append("request_id length")
    model = get("model")
    if isinstance(model, str) and model != MODEL:
        why.append("an unknown model")
    return why


# --------------------------------------------------------------------------- value pools

EDGE_INTS = [0, 1, -1, 2, 4, 8, 9, 20, 21, 512, 513, 10**6, 2**31 - 1, 2**31, 2**63 - 1,
             2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, -(2**64), 10**30]
EDGE_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-9, 1e-6, 2.0, 2.1, -2.1, 1e30, -1e30, 1e308,
               -1e308, 5e-324, NAN, INF, -INF]
JUNK = [None, "", "abc", "NaN", "inf", "-1", "1e400", [], [1], ["a"], {}, {"a": 1}, True, False,
        1.5, -1, 0, 10**30, "x" * 1000, [[[]]], {"": None}]


def pool(*values: Any) -> st.SearchStrategy:
    return st.sampled_from(list(values))


def with_junk(s: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(s, s, s, st.sampled_from(JUNK))


# Structured-output values, each with whether vLLM must refuse it: True (invalid), False (valid),
# None (no fixed answer). `_marked_invalid` looks values up here (by their JSON text).
_SCHEMAS = [
    ({"type": "object"}, False),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, False),
    ({"type": "string", "maxLength": 3}, False),
    ({"type": "strnig"}, None),
    ({"$ref": "#/nope"}, True),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
      "required": ["a"]}, None),
    ({"type": "string", "pattern": "("}, True),
    ({"type": "array", "minItems": 100000}, None),
    ({"type": "array", "items": {"$ref": "#"}}, None),
    ({"enum": []}, None),
    ({"anyOf": []}, None),
    ({"type": ["string", "null"]}, False),
    ({"properties": {"a": {"$ref": "#/properties/a"}}}, None),
    ({}, False),
    (True, None),
    (False, None),
    ("str", True),
    (5, True),
    ({"type": "integer", "minimum": 10**30}, None),
    ({"type": "number", "multipleOf": 0}, None),
]
_REGEXES = [("[a-z]{1,3}", False), ("(", True), ("a{10000}", None), ("", True), ("a*", False),
            ("[", True), ("(?P<x>a)(?P=x)", None), ("\\", True), ("a{3,1}", True),
            ("(a|b)*c", False), (".*", False), ("^$", None)]
_GRAMMARS = [('root ::= "a" | "b"', False), ("nonsense", True), ("root ::= root", None),
             ("root ::= [", True), ('root ::= "a"*', False), ('foo ::= "a"', True),
             ("", True), ('root ::= "' + "x" * 2000 + '"', False)]
_CHOICES = [(["yes", "no"], False), ([], True), ([""], True), (["a"] * 100, False),
            (["x" * 2000], False), ([5], None), (["🙂", "\u0000"], False)]

_VALIDITY: dict[tuple[str, str], bool | None] = {}


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, allow_nan=True)


def _tagged(field_name: str, items: list[tuple[Any, bool | None]]) -> list[Any]:
    for value, invalid in items:
        _VALIDITY[(field_name, _key(value))] = invalid
    return [v for v, _ in items]


def _structured_pools() -> dict[str, list[Any]]:
    so: list[tuple[Any, bool | None]] = []
    so += [({"json": s}, bad) for s, bad in _SCHEMAS]
    so += [({"json": json.dumps(s)}, bad) for s, bad in _SCHEMAS[:6]]
    so += [({"json": "{bad"}, True)]
    so += [({"regex": r}, bad) for r, bad in _REGEXES]
    so += [({"grammar": g}, bad) for g, bad in _GRAMMARS]
    so += [({"choice": c}, bad) for c, bad in _CHOICES]
    so += [({"json_object": True}, False), ({"json_object": False}, True),
           ({"json_object": "yes"}, None),
           ({"structural_tag": "junk"}, None), ({"structural_tag": {"a": 1}}, None),
           ({"regex": "a", "choice": ["a"]}, True), ({}, True), ({"frobnicate": 1}, True),
           ({"regex": "a", "disable_any_whitespace": "x"}, True),
           ({"json": {"type": "object"}, "disable_any_whitespace": True}, False)]
    rf: list[tuple[Any, bool | None]] = [({"type": "text"}, False), ({"type": "json_object"}, False),
                                         ({"type": "json_schema"}, True),
                                         ({"type": "json_schema", "json_schema": {"name": "x"}}, True),
                                         ({"type": "bogus"}, True)]
    rf += [({"type": "json_schema", "json_schema": {"name": "x", "schema": s, "strict": True}}, bad)
           for s, bad in _SCHEMAS]
    return {
        "structured_outputs": _tagged("structured_outputs", so),
        "response_format": _tagged("response_format", rf),
        "guided_json": _tagged("guided_json", [(s, bad) for s, bad in _SCHEMAS
                                               if isinstance(s, dict)] + [("{bad", True)]),
        "guided_regex": _tagged("guided_regex", _REGEXES),
        "guided_grammar": _tagged("guided_grammar", _GRAMMARS),
        "guided_choice": _tagged("guided_choice", _CHOICES),
    }


STRUCTURED_POOLS = _structured_pools()


def _marked_invalid(name: str, value: Any) -> bool:
    if value is None:
        return False
    try:
        return _VALIDITY.get((name, _key(value))) is True
    except (TypeError, ValueError):
        return False


BIG_LOGIT_BIAS = {str(i): 1.0 for i in range(100_000)}
VOCAB_LOGIT_BIAS = {str(i): -1.0 for i in range(VOCAB_SIZE)}
LOGIT_BIASES = [
    {"5": 1e30}, {"5": -1e30}, {"5": 1e308}, {str(VOCAB_SIZE): 1}, {str(VOCAB_SIZE - 1): 100},
    {"-1": 1}, {"abc": 1}, {"1.5": 1}, {"5": "x"}, {"5": None}, {"5": NAN}, {"5": INF},
    {" 5 ": 1}, {"-0": 1}, {"0x5": 1}, {"99999999999999999999": 1}, {"\u00b2": 1}, {"": 1},
    {"5": [1]}, {"5": "1"}, {}, [], "x", BIG_LOGIT_BIAS, VOCAB_LOGIT_BIAS,
]

small_max = st.integers(1, 4)
TOKEN_ID = st.integers(-2, VOCAB_SIZE + 2) | pool(0, VOCAB_SIZE - 1, VOCAB_SIZE, 10**12, 2**64)

COMMON_FIELDS: dict[str, st.SearchStrategy] = {
    "n": with_junk(pool(0, 1, 2, MAX_NUM_SEQS, MAX_NUM_SEQS + 1, 1000, 10**6, -1)),
    "best_of": with_junk(pool(None, 0, 1, 2, MAX_NUM_SEQS, MAX_NUM_SEQS + 1, 1000, 10**6)),
    "max_tokens": st.one_of(small_max, small_max, small_max,
                            pool(0, -1, 10**9, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 2**64, None),
                            st.sampled_from(JUNK)),
    "min_tokens": with_junk(pool(0, 1, 2, 3, 4, 5, 16, 17, 481, 5000, 10**9, 2**64, -1)),
    "temperature": with_junk(pool(*EDGE_FLOATS, "NaN", "nan", "inf", "-inf", 0, 2)),
    "top_p": with_junk(pool(*EDGE_FLOATS, "NaN", 0, 1)),
    "top_k": with_junk(pool(-2, -1, 0, 1, 5, VOCAB_SIZE, VOCAB_SIZE + 1, 2**31 - 1, 2**31, 2**63,
                            -(2**63))),
    "min_p": with_junk(pool(*EDGE_FLOATS, "NaN")),
    "presence_penalty": with_junk(pool(*EDGE_FLOATS)),
    "frequency_penalty": with_junk(pool(*EDGE_FLOATS)),
    "repetition_penalty": with_junk(pool(*EDGE_FLOATS)),
    "length_penalty": with_junk(pool(*EDGE_FLOATS)),
    "prompt_logprobs": with_junk(pool(-2, -1, 0, 1, 5, MAX_LOGPROBS, MAX_LOGPROBS + 1, 10**9,
                                      True)),
    "logit_bias": st.one_of(
        st.sampled_from(LOGIT_BIASES),
        st.dictionaries(TOKEN_ID.map(str) | st.text(max_size=4),
                        st.floats(allow_nan=True, allow_infinity=True)
                        | st.integers(-(10**40), 10**40), max_size=4)),
    "seed": st.one_of(pool(*EDGE_INTS), st.integers(-(2**65), 2**65), st.sampled_from(JUNK)),
    "stop": with_junk(pool("", [""], ["a", ""], [f"s{i}" for i in range(1000)], ["x" * 10_000],
                           "\n", [" "], [5], None, "Hello", ["\u0000"])
                      | st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": with_junk(pool([VOCAB_SIZE], [-1], [10**12], ["a"], [0], [2], [], [0.5])
                                | st.lists(TOKEN_ID, max_size=3)),
    "ignore_eos": with_junk(st.booleans()),
    "include_stop_str_in_output": with_junk(st.booleans()),
    "skip_special_tokens": with_junk(st.booleans()),
    "spaces_between_special_tokens": with_junk(st.booleans()),
    "use_beam_search": with_junk(st.booleans()),
    "allowed_token_ids": with_junk(pool([], [5], [VOCAB_SIZE], [-1], list(range(100)), None,
                                        [VOCAB_SIZE - 1])),
    "bad_words": with_junk(pool([""], ["hello"], ["x"] * 1000, [" "], "hello", [5], [],
                                ["a" * 5000])),
    "priority": with_junk(pool(0, 1, -1, 2**63)),
    "request_id": with_junk(pool("", "x" * 257, "a", "dup", "🙂")),
    "cache_salt": with_junk(pool("", "salt", 5)),
    "truncate_prompt_tokens": with_junk(pool(0, 1, 2, -1, 10**9, 2**64)),
    "return_token_ids": with_junk(st.booleans()),
    "stream": with_junk(st.booleans()),
    "stream_options": with_junk(pool(None, {}, {"include_usage": True},
                                     {"include_usage": False, "continuous_usage_stats": True},
                                     {"include_usage": True, "continuous_usage_stats": True},
                                     {"include_usage": "x"})),
    "model": with_junk(pool(None, MODEL, "nope", "")),
    "user": with_junk(pool("u")),
    "logits_processors": pool(["my.Processor"], None, []),
    "vllm_xargs": pool({"a": 1}, None),
    "modalities": pool(["text"], ["audio"], None),
    "guided_decoding_backend": pool("xgrammar", "outlines", None),
    **{name: with_junk(st.sampled_from(values)) for name, values in STRUCTURED_POOLS.items()},
}

COMPLETION_FIELDS: dict[str, st.SearchStrategy] = {
    "logprobs": with_junk(pool(-2, -1, 0, 1, 5, MAX_LOGPROBS, MAX_LOGPROBS + 1, 10**9, True,
                               False, None)),
    "echo": with_junk(st.booleans()),
    "suffix": with_junk(pool("", "x", None)),
    "add_special_tokens": with_junk(st.booleans()),
}

_TOOL_OK = {"type": "function", "function": {
    "name": "get_weather", "description": "d",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOLS = [
    [_TOOL_OK],
    [{"type": "function", "function": {"name": "f", "parameters": s}}
     for s, _ in _SCHEMAS if isinstance(s, dict)][:6],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nope"}}}],
    [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}],
    [{"type": "function", "function": {"name": "", "parameters": 5}}],
    [{"type": "function", "function": {"name": "f"}}],
    [{"type": "function", "function": {"name": "f", "parameters": None, "strict": True}}],
    [{"type": "function"}],
    [{"type": "bogus", "function": {"name": "f"}}],
    [_TOOL_OK, _TOOL_OK],
    [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
     for i in range(200)],
    [], None, {"a": 1}, "tools",
]
TOOL_CHOICES = ["none", "auto", "required", "bogus", None, 5, {},
                {"type": "function", "function": {"name": "get_weather"}},
                {"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "missing"}},
                {"function": {"name": "get_weather"}}, {"type": "function"}]
CHAT_TEMPLATES = ["{{ raise_exception('x') }}", "{% for %}", "{{ messages[5].content }}", "",
                  "{{ messages[0].content }}", "{% for m in messages %}{{ m.content }}{% endfor %}",
                  "{{ 1 / 0 }}", "{{ undefined_thing.attr }}", "{{ ''.__class__ }}",
                  "x" * 10_000, None, 5]

CHAT_FIELDS: dict[str, st.SearchStrategy] = {
    "logprobs": with_junk(st.booleans()),
    "top_logprobs": with_junk(pool(-2, -1, 0, 1, 5, MAX_LOGPROBS, MAX_LOGPROBS + 1, 10**9,
                                   True)),
    "max_completion_tokens": st.one_of(small_max, pool(0, -1, 10**9, MAX_MODEL_LEN, None),
                                       st.sampled_from(JUNK)),
    "tools": st.sampled_from(TOOLS),
    "tool_choice": st.sampled_from(TOOL_CHOICES),
    "parallel_tool_calls": with_junk(st.booleans()),
    "chat_template": st.sampled_from(CHAT_TEMPLATES),
    "chat_template_kwargs": with_junk(pool({"tools": 5}, {"add_generation_prompt": "x"},
                                           {"messages": 5}, {"chat_template": 5},
                                           {"enable_thinking": False}, {"tokenize": True},
                                           {"continue_final_message": True})),
    "add_generation_prompt": with_junk(st.booleans()),
    "continue_final_message": with_junk(st.booleans()),
    "echo": with_junk(st.booleans()),
    "include_reasoning": with_junk(st.booleans()),
    "add_special_tokens": with_junk(st.booleans()),
    "documents": pool([{"title": "t", "text": "x"}], None),
    "functions": pool([{"name": "f"}], None),
}

PROMPTS = ["Hello", "", " ", "\u0000", "🙂" * 20, "word " * 300, "word " * 600, "<|im_start|>",
           "<|endoftext|>" * 3, [1, 2, 3], [], [-1], [VOCAB_SIZE], [VOCAB_SIZE - 1], [10**12],
           [2**64], [[1, 2], [3]], [[]], ["a", "b"], [""], [1, "a"], None, 5, {"a": 1},
           [[VOCAB_SIZE]], ["Hello"] * 4, [0] * (MAX_MODEL_LEN + 1), [0] * (MAX_MODEL_LEN - 3),
           [True], [1.5], [[1.5]]]
PROMPT = st.one_of(st.sampled_from(PROMPTS), st.sampled_from(PROMPTS),
                   st.lists(TOKEN_ID, min_size=0, max_size=8), st.text(max_size=20))

_USER = {"role": "user", "content": "hi"}
MESSAGES_FIXED = [
    [_USER], [], [{"role": "robot", "content": "hi"}], [{"role": "user"}],
    [{"role": "user", "content": None}], [{"role": "user", "content": ""}],
    [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"text": "hi"}]}],
    [{"role": "user", "content": 5}], [{"content": "hi"}], ["hi"], "hi", None, {"a": 1},
    [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}, _USER],
    [_USER, {"role": "assistant", "content": "partial"}],
    [{"role": "assistant", "content": "x"}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
     {"role": "tool", "content": "r", "tool_call_id": "c"}],
    [{"role": "tool", "content": "r"}], [{"role": "user", "content": "word " * 300}],
    [{"role": "user", "content": "word " * 600}], [_USER] * 50,
    [{"role": "user", "content": "{{ messages }}{% raw %}"}],
]
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot", ""])},
    optional={"content": st.one_of(st.text(max_size=30), st.none(),
                                   st.lists(st.fixed_dictionaries(
                                       {"type": st.sampled_from(["text", "image_url", ""])},
                                       optional={"text": st.text(max_size=10) | st.none()}),
                                       max_size=2),
                                   st.sampled_from(JUNK)),
              "name": st.text(max_size=5) | st.sampled_from(JUNK),
              "tool_call_id": st.text(max_size=5)})
MESSAGES = st.one_of(st.sampled_from(MESSAGES_FIXED), st.sampled_from(MESSAGES_FIXED),
                     st.lists(MESSAGE, min_size=0, max_size=3))

UNKNOWN_NAMES = st.sampled_from(["frobnicate", "__proto__", "", "x" * 300, "n ", "N", "🙂",
                                 "max_tokens\u0000", "constructor"]) | st.text(max_size=8)


# ---------------------------------------------------------- values from the OpenAPI schema


def _schema_strategy(schema: Any, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values of a property's declared type (edge values), its refs resolved shallowly."""
    if not isinstance(schema, dict) or depth > 3:
        return st.sampled_from(JUNK)
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        target = components.get(name, {})
        props = target.get("properties", {})
        if not props:
            return st.sampled_from(JUNK)
        return st.fixed_dictionaries({}, optional={
            k: _schema_strategy(v, components, depth + 1) for k, v in props.items()})
    subs = schema.get("anyOf") or schema.get("oneOf")
    if subs:
        return st.one_of([_schema_strategy(s, components, depth + 1) for s in subs])
    if "enum" in schema:
        return st.sampled_from(list(schema["enum"]) + ["bogus"])
    if "const" in schema:
        return st.sampled_from([schema["const"], "bogus"])
    kind = schema.get("type")
    if kind == "integer":
        return pool(*EDGE_INTS)
    if kind == "number":
        return pool(*EDGE_FLOATS)
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return pool("", "a", "x" * 5000, "\u0000", "🙂", "NaN", "-1")
    if kind == "null":
        return st.none()
    if kind == "array":
        item = _schema_strategy(schema.get("items", {}), components, depth + 1)
        return st.lists(item, max_size=3)
    if kind == "object":
        return st.dictionaries(st.text(max_size=4), st.sampled_from(JUNK), max_size=2)
    return st.sampled_from(JUNK)


@pytest.fixture(scope="module")
def openapi_fields(fuzz_server) -> dict[str, dict[str, st.SearchStrategy]]:
    """Each request schema's properties (from the server's /openapi.json): field -> values."""
    r = fuzz_server.client.get("/openapi.json")
    assert r.status_code == 200, r.text[:300]
    components = r.json()["components"]["schemas"]
    out = {}
    for path, name in ((COMPLETIONS, "CompletionRequest"), (CHAT, "ChatCompletionRequest"),
                       (RESPONSES, "ResponsesRequest")):
        props = components[name]["properties"]
        out[path] = {k: st.one_of(_schema_strategy(v, components), st.sampled_from(JUNK))
                     for k, v in props.items()}
    # fields the hand-written edge values do not know yet get the schema's values only
    for path, known in ((COMPLETIONS, {**COMMON_FIELDS, **COMPLETION_FIELDS}),
                        (CHAT, {**COMMON_FIELDS, **CHAT_FIELDS}), (RESPONSES, RESPONSES_FIELDS)):
        schema_only = sorted(set(out[path]) - set(known) - {"prompt", "messages", "input"})
        if schema_only:
            print(f"\n{path}: fields fuzzed from the OpenAPI schema only: {schema_only}")
    return out


# ------------------------------------------------------------------------------ a case


def _effective_max(path: str, body: dict) -> Any:
    if path == RESPONSES:
        return body.get("max_output_tokens")
    if path == CHAT:
        v = body.get("max_completion_tokens")
        return body.get("max_tokens") if v is None else v
    return body.get("max_tokens", 16)


def _cap_generation(data, path: str, body: dict) -> None:
    """Keep accepted cases fast: at most a few generated tokens. A case that leaves max_tokens
    to the context gets a min_tokens past it (issue 23's reproduction), so that it is refused
    rather than run for the whole context."""
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        v = _int(body.get(name))
        if v is not None and 17 <= v < MAX_MODEL_LEN:
            body[name] = 4
    if _effective_max(path, body) is None:
        body["min_tokens"] = data.draw(pool(MAX_MODEL_LEN, 5000, 10**9, 2**64),
                                       label="min_tokens past the context")


# Values that are each accepted on their own: "mostly valid" cases combine several of them
# with one edge value, so that edge values also reach the engine (not only validation).
_VALID_SCHEMAS = [s for s, bad in _SCHEMAS if bad is False]
VALID_COMMON: dict[str, st.SearchStrategy] = {
    "n": st.integers(1, MAX_NUM_SEQS),
    "best_of": pool(None, MAX_NUM_SEQS),
    "max_tokens": small_max,
    "min_tokens": pool(0, 1, 2),
    "temperature": pool(0.0, 1e-6, 0.5, 1.0, 2.0, 1e30, 1e308, 0),
    "top_p": pool(1e-9, 0.1, 0.9, 1.0, 1),
    "top_k": pool(-1, 0, 1, 5, VOCAB_SIZE + 1, 2**31 - 1),
    "min_p": pool(0.0, 0.5, 1.0, 5e-324),
    "presence_penalty": pool(-2.0, 0.0, 2.0, 1e-9),
    "frequency_penalty": pool(-2.0, 0.0, 2.0),
    "repetition_penalty": pool(1e-30, 0.5, 1.0, 2.0, 1e30),
    "length_penalty": pool(-1.0, 0.0, 1.0, 2.0),
    "prompt_logprobs": pool(0, 1, MAX_LOGPROBS),
    "logit_bias": pool({"5": 1e30}, {"5": -1e30}, {str(VOCAB_SIZE - 1): 100}, {"0": 1e308},
                       {" 5 ": 1}, {"5": "1"}, {}, VOCAB_LOGIT_BIAS),
    "seed": st.integers(-(2**63), 2**63 - 1) | pool(-1, 0, 2**63 - 1, -(2**63)),
    "stop": pool(["a"], "\n", [f"s{i}" for i in range(1000)], ["x" * 10_000], [" "],
                 ["\u0000"], "Hello", []),
    "stop_token_ids": pool([0], [2], [VOCAB_SIZE - 1], []),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "use_beam_search": st.booleans(),
    "allowed_token_ids": pool([5], list(range(100)), [VOCAB_SIZE - 1], [0, 0]),
    "bad_words": pool(["hello"], ["a" * 5000], ["x"] * 1000),
    "request_id": pool("a", "dup", "🙂", "x" * 256),
    "cache_salt": pool("salt", "🙂"),
    "truncate_prompt_tokens": pool(1, 2, 10**9),
    "return_token_ids": st.booleans(),
    "stream": st.booleans(),
    "model": pool(None, MODEL),
    "structured_outputs": pool({"choice": ["yes", "no"]}, {"regex": "[a-z]{1,3}"},
                               {"json_object": True}, {"grammar": 'root ::= "a" | "b"'},
                               *({"json": s} for s in _VALID_SCHEMAS)),
    "response_format": pool({"type": "text"}, {"type": "json_object"},
                            *({"type": "json_schema", "json_schema": {"name": "x", "schema": s}}
                              for s in _VALID_SCHEMAS)),
    "guided_regex": pool("(a|b)*c", ".*"),
    "guided_choice": pool(["yes", "no"], ["a"] * 100),
}
VALID_COMPLETION: dict[str, st.SearchStrategy] = {
    "logprobs": pool(0, 1, 5, MAX_LOGPROBS),
    "echo": st.booleans(),
    "add_special_tokens": st.booleans(),
}
VALID_CHAT: dict[str, st.SearchStrategy] = {
    "logprobs": pool(True),
    "top_logprobs": pool(0, 1, MAX_LOGPROBS),
    "tools": pool([_TOOL_OK], [_TOOL_OK, _TOOL_OK]),
    "tool_choice": pool("none", "auto", "required",
                        {"type": "function", "function": {"name": "get_weather"}}),
    "chat_template": pool("{{ messages[0].content }}",
                          "{% for m in messages %}{{ m.content }}{% endfor %}"),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "echo": st.booleans(),
    "include_reasoning": st.booleans(),
    "parallel_tool_calls": st.booleans(),
}
VALID_PROMPTS = pool("Hello", "🙂" * 20, "word " * 300, "<|im_start|>", [1, 2, 3],
                     [VOCAB_SIZE - 1], [[1, 2], [3]], ["a", "b"], ["Hello"] * 4,
                     [0] * (MAX_MODEL_LEN - 5))
VALID_MESSAGES = pool([_USER], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                      [{"role": "system", "content": "s"}, _USER],
                      [_USER, {"role": "assistant", "content": "partial"}],
                      [{"role": "user", "content": "word " * 300}])


# ------------------------------------------------------------------- /v1/responses bodies

_FLAT_TOOL = {"type": "function", "name": "get_weather", "description": "d", "strict": False,
              "parameters": _TOOL_OK["function"]["parameters"]}
# each input with whether it must be refused: True, False (accepted), None (no fixed answer)
_RESPONSES_INPUTS = [
    ("Hello", False), ("", False), ("word " * 300, False), ("word " * 600, True),
    ("<|im_start|>", False), ([], True), ([{"role": "user", "content": "hi"}], False),
    ([{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
     False),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "partial"}], False),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "c", "output": "1"}], False),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"},
      {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text",
                                                                   "text": "1"}]}], None),
    ([{"type": "function_call_output", "call_id": "nope", "output": "1"}], True),
    ([{"type": "function_call", "name": 5}], True), ([{"type": "item_reference", "id": "x"}], True),
    ([{"role": "tool", "content": "x"}], True), ([{"role": "robot", "content": "x"}], True),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}], True),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], True),
    ([{"role": "user", "content": 5}], True), ([{"type": "reasoning", "summary": []}], True),
    (["hi"], True), ([None], True), ({"a": 1}, True), (None, True), (5, True),
    ([{"role": "user", "content": "hi"}] * 50, False),
]
RESPONSES_INPUTS = _tagged("input", _RESPONSES_INPUTS)
_TEXT_FORMATS = [({"format": {"type": "text"}}, False), ({"format": {"type": "json_object"}}, False),
                 *(({"format": {"type": "json_schema", "name": "x", "schema": s}}, bad)
                   for s, bad in _SCHEMAS if isinstance(s, dict)),
                 ({"format": {"type": "json_schema", "name": "x"}}, True),
                 ({"format": {"type": "json_schema", "schema": 5}}, True),
                 ({"format": {"type": "grammar"}}, True), ({"verbosity": "low"}, True),
                 ({"format": None}, False), ({}, False), ({"format": "json"}, True)]
TEXT_FORMATS = _tagged("text", _TEXT_FORMATS)
_RESPONSES_TOOLS = [
    ([_FLAT_TOOL], False), ([_FLAT_TOOL, {**_FLAT_TOOL, "name": "other"}], False),
    ([{**_FLAT_TOOL, "strict": True}], None), ([{"type": "web_search"}], True),
    ([{"type": "file_search", "vector_store_ids": []}], True), ([_TOOL_OK], True),
    ([{"type": "function", "name": "f", "parameters": {"type": "strnig"}}], None),
    ([{"type": "function", "name": "f", "parameters": 5}], None), ([{"type": "function"}], True),
    ([{"type": "function", "name": f"f{i}", "parameters": {"type": "object"}}
      for i in range(200)], False),
    ([], False), (None, False), ("tools", True), ({"a": 1}, True),
]
RESPONSES_TOOLS = _tagged("tools", _RESPONSES_TOOLS)
RESPONSES_TOOL_CHOICES = ["none", "auto", "required", {"type": "function", "name": "get_weather"},
                          {"type": "function", "name": "missing"}, {"type": "allowed_tools"},
                          {"type": "function", "function": {"name": "get_weather"}}, "bogus", 5,
                          None]
_PASSTHROUGH = ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                "structured_outputs", "cache_salt", "priority", "request_id", "logit_bias")

RESPONSES_FIELDS: dict[str, st.SearchStrategy] = {
    "instructions": with_junk(pool("Be brief.", "", "x" * 10_000, "{{ messages }}", None)),
    "max_output_tokens": st.one_of(small_max, small_max, small_max,
                                   pool(0, -1, 10**9, MAX_MODEL_LEN, None, 2**64),
                                   st.sampled_from(JUNK)),
    "temperature": COMMON_FIELDS["temperature"],
    "top_p": COMMON_FIELDS["top_p"],
    "tools": st.sampled_from(RESPONSES_TOOLS),
    "tool_choice": st.sampled_from(RESPONSES_TOOL_CHOICES),
    "parallel_tool_calls": with_junk(st.booleans()),
    "text": with_junk(st.sampled_from(TEXT_FORMATS)),
    "reasoning": with_junk(pool({"effort": "high"}, {"effort": "none"}, {"effort": "extreme"},
                                {"summary": "auto"}, {}, {"effort": None})),
    "metadata": with_junk(pool({"a": "b"}, {str(i): "v" for i in range(17)}, {"k" * 65: "v"},
                               {"a": "v" * 513}, {"a": 5}, {})),
    "user": with_junk(pool("u")),
    "store": with_junk(st.booleans()),
    "previous_response_id": with_junk(pool("resp_" + "0" * 48, "resp_\u0000")),
    "background": with_junk(st.booleans()),
    "truncation": with_junk(pool("auto", "disabled")),
    "include": with_junk(pool([], ["reasoning.encrypted_content"])),
    "stream": with_junk(st.booleans()),
    "model": COMMON_FIELDS["model"],
    "chat_template_kwargs": CHAT_FIELDS["chat_template_kwargs"],
    **{name: COMMON_FIELDS[name] for name in _PASSTHROUGH},
}
VALID_RESPONSES: dict[str, st.SearchStrategy] = {
    **{name: VALID_COMMON[name] for name in _PASSTHROUGH + ("temperature", "top_p", "stream",
                                                            "model") if name in VALID_COMMON},
    "instructions": pool("Be brief.", ""),
    "tools": pool([_FLAT_TOOL]),
    "tool_choice": pool("none", "required", {"type": "function", "name": "get_weather"}),
    "parallel_tool_calls": st.booleans(),
    "text": pool(*(t for t, bad in _TEXT_FORMATS if bad is False)),
    "metadata": pool({"a": "b"}, {}),
    "user": pool("u"),
    "store": st.booleans(),
    "background": st.booleans(),
    "truncation": pool("disabled"),
    "include": pool([]),
}
VALID_RESPONSES_INPUTS = pool(*(i for i, bad in _RESPONSES_INPUTS if bad is False))


def _draw_schema_and_unknown_fields(data, body: dict, schema_fields: dict) -> None:
    """Up to two fields of the server's schema with a value of their declared type (or junk),
    and now and then an unknown field."""
    for name in data.draw(st.lists(st.sampled_from(sorted(schema_fields)), max_size=2,
                                   unique=True), label="schema fields"):
        body[name] = data.draw(schema_fields[name], label=f"{name} (schema)")
    if data.draw(st.integers(0, 4), label="unknown field?") == 0:
        body[data.draw(UNKNOWN_NAMES, label="unknown name")] = data.draw(
            st.sampled_from(JUNK), label="unknown value")


def draw_responses_body(data, schema_fields: dict, mostly_valid: bool) -> dict:
    """A /v1/responses body, drawn as draw_case draws the others."""
    body: dict[str, Any] = {}
    if mostly_valid:
        body["input"] = data.draw(VALID_RESPONSES_INPUTS, label="input")
        for name in data.draw(st.lists(st.sampled_from(sorted(VALID_RESPONSES)), max_size=6,
                                       unique=True), label="valid fields"):
            body[name] = data.draw(VALID_RESPONSES[name], label=name)
        if data.draw(st.integers(0, 3), label="edge value?") > 0:
            name = data.draw(st.sampled_from(sorted(RESPONSES_FIELDS)), label="edge field")
            body[name] = data.draw(RESPONSES_FIELDS[name], label=f"{name} (edge)")
        # what makes two accepted values a refusal together
        if body.get("tool_choice") not in (None, "none") and not body.get("tools"):
            body.pop("tool_choice")
        if body.get("background") is True and body.get("store") is False:
            body.pop("store")
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        if isinstance(fmt, dict) and fmt.get("type") != "text":
            body.pop("structured_outputs", None)
    else:
        body["input"] = data.draw(st.sampled_from(RESPONSES_INPUTS) | st.text(max_size=20),
                                  label="input")
        for name in data.draw(st.lists(st.sampled_from(sorted(RESPONSES_FIELDS)), max_size=6,
                                       unique=True), label="fields"):
            body[name] = data.draw(RESPONSES_FIELDS[name], label=name)
        _draw_schema_and_unknown_fields(data, body, schema_fields)
    if "max_output_tokens" not in body and data.draw(st.integers(0, 9)) > 0:
        body["max_output_tokens"] = data.draw(small_max, label="max_output_tokens (capped)")
    return body


def must_refuse_responses(body: dict) -> list[str]:
    """The Responses rules a 4xx is certain for: chat's rules on the fields passed through to
    the chat path, and the Responses API's own (refused fields, item types, the store)."""
    get = body.get
    chat_like = {k: body[k] for k in _PASSTHROUGH + ("temperature", "top_p", "model", "stream")
                 if k in body}
    chat_like["max_completion_tokens"] = get("max_output_tokens")
    why = must_refuse(CHAT, chat_like)
    max_out = _int(get("max_output_tokens"))
    if max_out is not None and max_out < 1:
        why.append("max_output_tokens < 1")
    if get("background") is True and get("store") is False:
        why.append("background without store")
    if get("truncation") == "auto":
        why.append("truncation auto")
    if isinstance(get("include"), list) and get("include"):
        why.append("include")
    if isinstance(get("reasoning"), dict) and any(v is not None for v in get("reasoning").values()):
        why.append("reasoning (no summaries; SmolLM2's template reads no reasoning_effort)")
    if isinstance(get("previous_response_id"), str):
        why.append("an unknown previous_response_id")
    meta = get("metadata")
    if isinstance(meta, dict) and (len(meta) > 16 or any(
            isinstance(k, str) and len(k) > 64 or isinstance(v, str) and len(v) > 512
            for k, v in meta.items())):
        why.append("metadata past its limits")
    for name in ("input", "text", "tools"):
        if _marked_invalid(name, get(name)):
            why.append(f"invalid {name}")
    tools = get("tools")
    if isinstance(tools, list) and tools and get("tool_choice") in (None, "auto"):
        if not _marked_invalid("tools", tools):
            why.append("tool_choice auto without --tool-call-parser")
    return why


def draw_case(data, fields_from_schema: dict) -> tuple[str, dict]:
    """Half the cases: any values of up to six fields, one or two fields of the OpenAPI schema
    and now and then an unknown field. The other half: accepted values of up to six fields plus
    one edge value."""
    path = data.draw(pool(COMPLETIONS, CHAT, RESPONSES), label="endpoint")
    if path == RESPONSES:
        mostly_valid = data.draw(st.booleans(), label="mostly valid")
        body = draw_responses_body(data, fields_from_schema[path], mostly_valid)
        _cap_generation(data, path, body)
        return path, body
    chat = path == CHAT
    table = {**COMMON_FIELDS, **(CHAT_FIELDS if chat else COMPLETION_FIELDS)}
    valid = {**VALID_COMMON, **(VALID_CHAT if chat else VALID_COMPLETION)}
    mostly_valid = data.draw(st.booleans(), label="mostly valid")
    body: dict[str, Any] = {}
    if mostly_valid:
        body["messages" if chat else "prompt"] = data.draw(
            VALID_MESSAGES if chat else VALID_PROMPTS, label="prompt")
        for name in data.draw(st.lists(st.sampled_from(sorted(valid)), max_size=6, unique=True),
                              label="valid fields"):
            body[name] = data.draw(valid[name], label=name)
        if data.draw(st.integers(0, 3), label="edge value?") > 0:
            name = data.draw(st.sampled_from(sorted(table)), label="edge field")
            body[name] = data.draw(table[name], label=f"{name} (edge)")
    else:
        body["messages" if chat else "prompt"] = data.draw(MESSAGES if chat else PROMPT,
                                                           label="prompt")
        names = data.draw(st.lists(st.sampled_from(sorted(table)), max_size=6, unique=True),
                          label="fields")
        for name in names:
            body[name] = data.draw(table[name], label=name)
        _draw_schema_and_unknown_fields(data, body, fields_from_schema[path])
    if "max_tokens" not in body and (chat and "max_completion_tokens" not in body
                                     or data.draw(st.integers(0, 9)) > 0):
        body["max_tokens"] = data.draw(small_max, label="max_tokens (capped)")
    if mostly_valid:
        # what makes two accepted values a refusal together
        if body.get("stream") is not True:
            body.pop("stream_options", None)
        if _int(body.get("best_of")) is not None and _int(body.get("n")) is not None:
            body["best_of"] = max(body["best_of"], body["n"])
        if body.get("use_beam_search") is True:
            for name in ("temperature", "top_p", "top_k", "min_p", "allowed_token_ids",
                         "bad_words", "structured_outputs", "response_format", "guided_regex",
                         "guided_choice", "best_of", "min_tokens", "presence_penalty",
                         "frequency_penalty", "repetition_penalty", "logit_bias", "seed",
                         "stop", "logprobs", "top_logprobs", "prompt_logprobs"):
                body.pop(name, None)
        present = [k for k in _STRUCTURED + ("response_format",) if k in body]
        for name in present[1:]:
            body.pop(name)
    _cap_generation(data, path, body)
    return path, body


# ------------------------------------------------------------------------- running cases


@dataclass
class Failure:
    path: str
    body: Any
    problems: list[str]
    answer: str
    status: int | None
    after: dict
    fatal: bool  # the server had to be restarted
    seconds: float
    count: int = 1
    original_body: Any = None
    log_excerpt: str = ""
    bystander: bool = False
    disconnect: bool = False

    def signature(self) -> tuple:
        """Failures alike: the endpoint, the status, the problems and the error message, their
        numbers (and ids) left out."""
        problems = tuple(sorted(_normalise(p)[:120] for p in self.problems))
        message = "" if self.status == 200 else _message(self.answer)
        return (self.path, self.status, problems, message)

    def as_dict(self) -> dict:
        return {"endpoint": self.path, "body": _short(self.body),
                "original_body": _short(self.original_body), "problems": self.problems,
                "answer": self.answer, "after": self.after, "server_restarted": self.fatal,
                "seconds": round(self.seconds, 2), "count": self.count,
                "with_concurrent_request": self.bystander, "disconnected": self.disconnect,
                "log_excerpt": self.log_excerpt}


def _normalise(text: str) -> str:
    text = re.sub(r"(cmpl|chatcmpl)-[0-9a-f]+", "ID", text)
    return re.sub(r"-?\d[\d.e+]*", "N", text)


def _message(answer: str) -> str:
    m = re.search(r'"message":\s*"([^"]{0,100})', answer)
    return _normalise(m.group(1) if m else answer[:100])


def _short(body: Any, limit: int = 1500) -> Any:
    text = json.dumps(body, allow_nan=True)
    return body if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _error_lines(log: str) -> str:
    lines = [ln for ln in log.splitlines()
             if re.search(r"Error|error|Traceback|died|fatal|Exception", ln)]
    return "\n".join(lines[-12:])[-2500:]


def run_case(server: FuzzServer, path: str, body: Any, raw: bytes | None = None,
             refuse_reasons: list[str] | None = None, bystander: bool = False,
             disconnect: bool = False) -> tuple[Answer, Failure | None]:
    """Send one case (with a concurrent plain request, or closing a stream early when asked),
    check its answer and the server afterwards; restart a dead server."""
    log_before = len(server.log_tail(1 << 22))
    by = None
    if bystander:
        by = Bystander(server)
        by.start()
        by.decoding.wait(ALIVE_TIMEOUT_S)
    ans = send(server.client, path, body, raw=raw, disconnect=disconnect)
    problems = answer_problems(ans, path)
    reasons = must_refuse(path, body) if refuse_reasons is None else refuse_reasons
    if reasons and ans.status == 200:
        problems.append(f"accepted (200) although it must be refused: {'; '.join(reasons)}")
    if by is not None:
        by.join(CASE_TIMEOUT_S + 5)
        if by.is_alive():
            problems.append("a concurrent plain request did not finish")
        elif by.problem:
            problems.append(f"a concurrent plain request failed: {by.problem}")
    after_problems, after = alive_problems(server)
    problems += after_problems
    if not after_problems:
        problems += idle_problems(server)
    if not problems:
        return ans, None
    log = server.log_tail(1 << 22)[log_before:]
    fatal = bool(after_problems)
    failure = Failure(path, body, problems, ans.excerpt(), ans.status, after, fatal,
                      ans.seconds, original_body=body, log_excerpt=_error_lines(log),
                      bystander=bystander, disconnect=disconnect)
    if fatal:
        server.restart()
    return ans, failure


class Collector:
    """Distinct failures of the run (by endpoint, kinds of problem and error message)."""

    def __init__(self, server: FuzzServer) -> None:
        self.server = server
        self.failures: dict[tuple, Failure] = {}
        self.cases = 0
        self.statuses: collections.Counter = collections.Counter()  # (endpoint, status)
        self.minimize_spent = 0.0
        self.stopped_early = False
        self.restarts_before = server.restarts

    @property
    def restarts(self) -> int:
        return self.server.restarts - self.restarts_before

    def add(self, failure: Failure | None) -> None:
        if failure is None:
            return
        sig = failure.signature()
        if sig in self.failures:
            self.failures[sig].count += 1
            return
        self.failures[sig] = self._minimize(failure)

    def _minimize(self, failure: Failure) -> Failure:
        """Drop top-level fields while the body still fails the same way."""
        if not isinstance(failure.body, dict) or self.minimize_spent > MINIMIZE_BUDGET_S:
            return failure
        t0 = time.monotonic()
        best = failure
        required = {"prompt", "messages", "input"}
        for key in sorted(failure.body, key=lambda k: -len(json.dumps(failure.body[k],
                                                                      allow_nan=True))):
            if key in required or key not in best.body:
                continue
            if self.minimize_spent + (time.monotonic() - t0) > MINIMIZE_BUDGET_S:
                break
            if self.restarts >= MAX_RESTARTS:
                break
            trial = {k: v for k, v in best.body.items() if k != key}
            _, f = run_case(self.server, failure.path, trial, bystander=failure.bystander,
                            disconnect=failure.disconnect)
            if f is not None and f.signature() == failure.signature():
                f.original_body = failure.original_body
                best = f
        self.minimize_spent += time.monotonic() - t0
        return best

    def report(self) -> str:
        lines = [f"{len(self.failures)} distinct failure(s) in {self.cases} cases "
                 f"({self.restarts} server restart(s)"
                 f"{', stopped early' if self.stopped_early else ''}):"]
        for f in self.failures.values():
            how = (" (with a concurrent request)" if f.bystander else "") + \
                (" (stream closed after its first event)" if f.disconnect else "")
            lines.append(f"- POST {f.path} {json.dumps(_short(f.body, 600), allow_nan=True)}{how}")
            lines.append(f"    answer: {f.answer[:300]}")
            lines.append(f"    problems: {f.problems}")
            lines.append(f"    afterwards: {f.after}  (seen {f.count}x, "
                         f"restarted: {f.fatal})")
            if f.log_excerpt:
                lines.append("    log: " + f.log_excerpt.replace("\n", "\n         ")[-800:])
        return "\n".join(lines)

    def dump(self, name: str) -> None:
        if not REPORT_PATH:
            return
        try:
            with open(REPORT_PATH) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            data = {}
        data[name] = {"cases": self.cases, "restarts": self.restarts,
                      "stopped_early": self.stopped_early,
                      "failures": [f.as_dict() for f in self.failures.values()]}
        with open(REPORT_PATH, "w") as fh:
            json.dump(data, fh, indent=1, allow_nan=True, default=str)


# ------------------------------------------------------------------------------ the fixed cases


@dataclass
class Fixed:
    id: str
    path: str
    body: Any
    expect: str | None  # "ok" (200), "refuse" (a 4xx), None (only the invariant)
    names: tuple[str, ...] = ()  # a refusal must name one of these (message or param)
    raw: bytes | None = None
    extra: dict = field(default_factory=dict)


def _chat(**kw) -> dict:
    return {"messages": [_USER], **kw}


def _resp(**kw) -> dict:
    return {"input": "Hello", "max_output_tokens": 2, **kw}


def _cmpl(**kw) -> dict:
    return {"prompt": "Hello", "max_tokens": 2, **kw}


FIXED_CASES = [
    # issue 23's reproductions
    Fixed("chat min_tokens=5000, no max_tokens (killed the core's input thread)", CHAT,
          _chat(min_tokens=5000), "refuse", ("min_tokens",)),
    Fixed("chat min_tokens=5000, no max_tokens, stream", CHAT,
          _chat(min_tokens=5000, stream=True), "refuse", ("min_tokens",)),
    Fixed("completions min_tokens=5000, max_tokens null", COMPLETIONS,
          _cmpl(min_tokens=5000, max_tokens=None), "refuse", ("min_tokens",)),
    Fixed("best_of=1000000", COMPLETIONS, _cmpl(best_of=10**6), "refuse", ("best_of",)),
    Fixed("chat best_of=1000000", CHAT, _chat(max_tokens=2, best_of=10**6), "refuse",
          ("best_of",)),
    Fixed("n=1000", COMPLETIONS, _cmpl(n=1000), "refuse", ("n",)),
    Fixed("chat n=1000", CHAT, _chat(max_tokens=2, n=1000), "refuse", ("n",)),
    Fixed("n=max_num_seqs+1", COMPLETIONS, _cmpl(n=MAX_NUM_SEQS + 1), "refuse", ("n",)),
    Fixed("best_of=max_num_seqs+1", COMPLETIONS, _cmpl(best_of=MAX_NUM_SEQS + 1), "refuse",
          ("best_of",)),
    Fixed("n=best_of=max_num_seqs", COMPLETIONS, _cmpl(n=MAX_NUM_SEQS, best_of=MAX_NUM_SEQS),
          "ok"),
    Fixed("logit_bias 1e30", COMPLETIONS, _cmpl(logit_bias={"5": 1e30}), "ok"),
    Fixed("chat logit_bias -1e30", CHAT, _chat(max_tokens=2, logit_bias={"5": -1e30}), "ok"),
    Fixed("seed=2**64", COMPLETIONS, _cmpl(seed=2**64), "refuse", ("seed",)),
    Fixed("seed=-2**64", COMPLETIONS, _cmpl(seed=-(2**64)), "refuse", ("seed",)),
    Fixed("seed=2**63-1", COMPLETIONS, _cmpl(seed=2**63 - 1), "ok"),
    Fixed("logprobs=-1 on completions", COMPLETIONS, _cmpl(logprobs=-1), "refuse",
          ("logprobs",)),
    Fixed("chat top_logprobs=-1", CHAT, _chat(max_tokens=2, logprobs=True, top_logprobs=-1),
          "refuse", ("top_logprobs",)),
    Fixed("min_tokens>max_tokens", COMPLETIONS, _cmpl(min_tokens=3), "refuse", ("min_tokens",)),
    # unknown fields whose names cannot be an HTTP header value (found by this fuzzer: they
    # went into X-Pagedllm-Ignored-Fields and the connection was dropped without an answer)
    Fixed("unknown field 'n '", COMPLETIONS, _cmpl(**{"n ": 1}), "ok"),
    Fixed("chat unknown field 'n '", CHAT, _chat(max_tokens=2, **{"n ": None}), "ok"),
    Fixed("unknown field with a NUL", COMPLETIONS, _cmpl(**{"max_tokens\u0000": 1}), "ok"),
    Fixed("unknown field with a newline", COMPLETIONS, _cmpl(**{"a\r\nSet-Cookie: x": 1}), "ok"),
    Fixed("unknown field non-ASCII", COMPLETIONS, _cmpl(**{"🙂": 1}), "ok"),
    Fixed("unknown field latin-1", CHAT, _chat(max_tokens=2, **{"caf\u00e9": 1}), "ok"),
    Fixed("unknown field empty name", COMPLETIONS, _cmpl(**{"": 1}), "ok"),
    Fixed("1000 unknown fields", COMPLETIONS, _cmpl(**{f"f{i}": i for i in range(1000)}), "ok"),
    # request ids that cannot be an X-Request-Id header value (found by this fuzzer: a NUL
    # dropped the connection). vLLM takes any string as the id; control characters may be
    # refused (a 400), but never left without an answer.
    Fixed("request_id NUL", COMPLETIONS, _cmpl(request_id="\u0000"), None),
    Fixed("request_id CRLF", CHAT, _chat(max_tokens=2, request_id="a\r\nSet-Cookie: x"), None),
    Fixed("request_id non-ASCII", COMPLETIONS, _cmpl(request_id="🙂"), "ok"),
    Fixed("request_id latin-1", COMPLETIONS, _cmpl(request_id="caf\u00e9"), "ok"),
    # beam search with a finite but huge length penalty (found by this fuzzer)
    Fixed("beam length_penalty=1e308", COMPLETIONS,
          _cmpl(use_beam_search=True, n=MAX_NUM_SEQS, length_penalty=1e308), None),
    Fixed("beam length_penalty=1000, 8 tokens", COMPLETIONS,
          _cmpl(use_beam_search=True, n=2, length_penalty=1000.0, max_tokens=8, ignore_eos=True),
          None),
    Fixed("chat beam length_penalty=-1e308", CHAT,
          _chat(max_tokens=2, use_beam_search=True, n=2, length_penalty=-1e308), None),
    # /v1/responses (issue 46): refusals by name, background runs, streams left early
    Fixed("responses background without store", RESPONSES,
          _resp(background=True, store=False), "refuse", ("background",)),
    Fixed("responses background", RESPONSES, _resp(background=True), "ok"),
    Fixed("responses background stream", RESPONSES, _resp(background=True, stream=True), "ok"),
    Fixed("responses empty input list", RESPONSES, _resp(input=[]), "refuse", ("input",)),
    Fixed("responses unknown previous_response_id", RESPONSES,
          _resp(previous_response_id="resp_" + "0" * 48), "refuse", ("previous_response_id",)),
    Fixed("responses max_output_tokens=0", RESPONSES, _resp(max_output_tokens=0), "refuse",
          ("max_output_tokens",)),
    Fixed("responses max_output_tokens past the context", RESPONSES,
          _resp(max_output_tokens=10**9), "refuse", ("maximum context length",)),  # vLLM's words
    Fixed("responses truncation auto", RESPONSES, _resp(truncation="auto"), "refuse",
          ("truncation",)),
    Fixed("responses reasoning effort, template without it", RESPONSES,
          _resp(reasoning={"effort": "high"}), "refuse", ("reasoning.effort",)),
    Fixed("responses schema the grammar refuses", RESPONSES,
          _resp(text={"format": {"type": "json_schema", "name": "x",
                                 "schema": {"type": "string", "pattern": "("}}}), "refuse",
          ("text.format.schema",)),
    Fixed("responses unknown call_id", RESPONSES,
          _resp(input=[{"type": "function_call_output", "call_id": "x", "output": "1"}]),
          "refuse", ("input[0].call_id",)),
    Fixed("responses hosted tool", RESPONSES, _resp(tools=[{"type": "web_search"}]), "refuse",
          ("tools[0].type",)),
    Fixed("responses min_tokens past the context, no max_output_tokens", RESPONSES,
          {"input": "Hello", "min_tokens": 5000}, "refuse", ("min_tokens",)),
    Fixed("responses input is an object", RESPONSES, _resp(input={"a": 1}), "refuse",
          ("input",)),
    # bodies that are not a request object
    Fixed("empty body", COMPLETIONS, None, "refuse", raw=b""),
    Fixed("truncated JSON", COMPLETIONS, None, "refuse", raw=b'{"prompt": "Hel'),
    Fixed("a JSON list", CHAT, None, "refuse", raw=b"[]"),
    Fixed("JSON null", COMPLETIONS, None, "refuse", raw=b"null"),
    Fixed("a JSON string", CHAT, None, "refuse", raw=b'"hi"'),
    Fixed("deeply nested JSON", COMPLETIONS, None, "refuse",
          raw=b'{"prompt": "Hello", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    Fixed("not UTF-8", COMPLETIONS, None, "refuse", raw=b'{"prompt": "\xff\xfe"}'),
    Fixed("huge float (inf)", COMPLETIONS, None, "refuse",
          raw=b'{"prompt": "Hello", "max_tokens": 2, "temperature": 1' + b"0" * 5000 + b".0}"),
    Fixed("huge integer", COMPLETIONS, None, "refuse",
          raw=b'{"prompt": "Hello", "max_tokens": 2, "seed": 1' + b"0" * 5000 + b"}"),
]


@pytest.mark.parametrize("case", FIXED_CASES, ids=[c.id for c in FIXED_CASES])
def test_fixed_boundary_case(fuzz_server, case):
    """Each reproduction gets its answer, and the server keeps serving."""
    if fuzz_server.srv.proc.poll() is not None:
        fuzz_server.restart()
    refuse = ["fixed case: must be refused"] if case.expect == "refuse" else []
    ans, failure = run_case(fuzz_server, case.path, case.body, raw=case.raw,
                            refuse_reasons=refuse, bystander=True)
    problems = list(failure.problems) if failure else []
    if case.expect == "ok" and ans.status != 200:
        problems.append(f"must be accepted (200), got {ans.excerpt(300)}")
    if case.expect == "refuse" and ans.status is not None and 400 <= ans.status < 500 \
            and case.names:
        err = (ans.body or {}).get("error", {}) if isinstance(ans.body, dict) else {}
        said = f"{err.get('message', '')} {err.get('param') or ''}"
        if not any(re.search(rf"\b{re.escape(n)}\b", said) for n in case.names):
            problems.append(f"the refusal does not name {case.names}: {ans.excerpt(300)}")
    assert not problems, (f"{case.id}: POST {case.path} "
                          f"{_short(case.body, 400) if case.raw is None else case.raw[:200]!r}"
                          f"\n  answer: {ans.excerpt(400)}\n  problems: {problems}"
                          f"\n  afterwards: {failure.after if failure else 'ok'}"
                          f"\n  log: {failure.log_excerpt if failure else ''}")


# --------------------------------------------------------------------------------- the fuzzer


def test_boundary_fuzz(fuzz_server, openapi_fields):
    """N_EXAMPLES generated bodies; every distinct failure is reported at the end."""
    if fuzz_server.srv.proc.poll() is not None:
        fuzz_server.restart()
    collector = Collector(fuzz_server)
    t0 = time.monotonic()

    @settings(max_examples=N_EXAMPLES, deadline=None, derandomize=SEED is None, database=None,
              phases=[Phase.explicit, Phase.generate], print_blob=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much,
                                     HealthCheck.large_base_example])
    @given(data=st.data())
    def one_case(data):
        if collector.restarts >= MAX_RESTARTS:
            collector.stopped_early = True
            return
        path, body = draw_case(data, openapi_fields)
        bystander = data.draw(st.integers(0, 3), label="concurrent plain request?") == 0
        disconnect = body.get("stream") is True and data.draw(st.integers(0, 3),
                                                              label="disconnect early?") == 0
        collector.cases += 1
        ans, failure = run_case(fuzz_server, path, body, bystander=bystander,
                                disconnect=disconnect)
        collector.statuses[(path, ans.status)] += 1
        collector.add(failure)

    if SEED is not None:
        one_case = seed(int(SEED))(one_case)
    one_case()
    elapsed = time.monotonic() - t0
    print(f"\nboundary fuzz: {collector.cases} cases in {elapsed:.1f} s, "
          f"{len(collector.failures)} distinct failure(s), {collector.restarts} restart(s); "
          f"answers: {dict(sorted(collector.statuses.items(), key=str))}")
    collector.dump("fuzz")
    assert not collector.failures, collector.report()
    assert collector.cases >= min(N_EXAMPLES, 500) or collector.stopped_early, (
        f"only {collector.cases} cases ran")
