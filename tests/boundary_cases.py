"""Sampling edge cases shared by the boundary tests (issue 23, "one request, one fault: never the
whole server").

`SAMPLING_CASES` is a table of `SamplingParams` keyword arguments plus a prompt, each with the
answer vLLM gives it: "accept" (the request runs), "refuse" (a ValueError offline, a 400 from
the server) or None (no fixed answer, but the offline engine and the server must give the same
one). tests/integration/test_boundary_offline.py sends every case both ways
(`LLM.generate(prompt, SamplingParams(**kwargs))` and POST /v1/completions with the same fields,
`http_body`) on engines configured alike (`ENGINE`), and compares.

The rules the table encodes (vLLM's):
- n and best_of are at most the engine's max_num_seqs, best_of >= n, n >= 1;
- logit_bias values are clamped to [-100, 100] (so 1e30 is accepted), keys are in-vocabulary
  token ids;
- a seed outside [-2**63, 2**64 - 1] is refused;
- min_tokens > max_tokens is refused, also when max_tokens is filled from what is left of the
  context (max_tokens=None);
- logprobs / prompt_logprobs = -1 is the whole vocabulary, then limited by max_logprobs (20 by
  default: so refused here, on both sides alike);
- the prompt plus max_tokens fit in max_model_len; an empty prompt and an out-of-vocabulary
  token id are refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# The engines both sides run: the default model (SmolLM2-135M-Instruct), a short context and a
# small batch, so that "past the context" and "more samples than max_num_seqs" are cheap to hit.
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
MAX_LOGPROBS = 20  # the default --max-logprobs
VOCAB_SIZE = 49152  # SmolLM2's vocabulary (checked against the engine by the tests)
KV_CACHE_SPACE = 0.5  # GiB
ENGINE = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, kv_cache_space=KV_CACHE_SPACE)
SERVE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
              "--kv-cache-space", str(KV_CACHE_SPACE)]

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what the brief of issue 23 allows (see the table)

# A prompt that leaves room for exactly two generated tokens: MAX_MODEL_LEN - 2 token ids.
ALMOST_FULL = [28] * (MAX_MODEL_LEN - 2)

ACCEPT, REFUSE = "accept", "refuse"


@dataclass
class SamplingCase:
    id: str
    kwargs: dict[str, Any]
    expect: str | None  # ACCEPT, REFUSE, or None: only "both sides agree"
    prompt: str | list[int] = "Hello"
    note: str = ""

    @property
    def offline_prompt(self) -> str | dict[str, Any]:
        if isinstance(self.prompt, list):
            return {"prompt_token_ids": list(self.prompt)}
        return self.prompt

    def http_body(self) -> dict[str, Any]:
        """The /v1/completions body asking for the same thing (the HTTP names are the
        SamplingParams names; logit_bias keys are strings in JSON)."""
        body: dict[str, Any] = {"prompt": self.prompt}
        for name, value in self.kwargs.items():
            if name == "logit_bias" and isinstance(value, dict):
                value = {str(k): v for k, v in value.items()}
            body[name] = value
        return body

    def http_content(self) -> bytes:
        """The body as JSON text; NaN and Infinity as Python's json writes them (the server's
        parser reads them, so they reach validation)."""
        return json.dumps(self.http_body(), allow_nan=True).encode()


def _case(id: str, expect: str | None, prompt: str | list[int] = "Hello", note: str = "",
          **kwargs: Any) -> SamplingCase:
    # Accepted cases must be cheap: two generated tokens unless the case is about max_tokens.
    kwargs.setdefault("max_tokens", 2)
    return SamplingCase(id, kwargs, expect, prompt, note)


NAN, INF = math.nan, math.inf

SAMPLING_CASES: list[SamplingCase] = [
    # ---- max_tokens / min_tokens ------------------------------------------------------------
    _case("max_tokens=1", ACCEPT, max_tokens=1),
    _case("max_tokens=0", REFUSE, max_tokens=0),
    _case("max_tokens=-1", REFUSE, max_tokens=-1),
    _case("max_tokens=10**9", REFUSE, max_tokens=10**9),
    _case("max_tokens=2**64", REFUSE, max_tokens=2**64),
    _case("max_tokens=max_model_len", REFUSE, max_tokens=MAX_MODEL_LEN),
    _case("prompt+max_tokens=max_model_len", ACCEPT, prompt=ALMOST_FULL, max_tokens=2),
    _case("prompt+max_tokens=max_model_len+1", REFUSE, prompt=ALMOST_FULL, max_tokens=3),
    _case("max_tokens=None,prompt fills all but 1", ACCEPT, prompt=[28] * (MAX_MODEL_LEN - 1),
          max_tokens=None),
    _case("max_tokens=None,prompt fills the context", REFUSE, prompt=[28] * MAX_MODEL_LEN,
          max_tokens=None),
    _case("prompt past the context", REFUSE, prompt=[28] * (MAX_MODEL_LEN + 1)),
    _case("min_tokens=max_tokens", ACCEPT, min_tokens=2, max_tokens=2),
    _case("min_tokens>max_tokens", REFUSE, min_tokens=3, max_tokens=2),
    _case("min_tokens=-1", REFUSE, min_tokens=-1),
    _case("min_tokens=5000,max_tokens=None", REFUSE, min_tokens=5000, max_tokens=None,
          note="max_tokens is filled from the remaining context (511), then min > max"),
    _case("min_tokens=remaining+1,max_tokens=None", REFUSE, prompt=[28] * (MAX_MODEL_LEN - 3),
          min_tokens=4, max_tokens=None),
    _case("min_tokens=remaining,max_tokens=None", ACCEPT, prompt=[28] * (MAX_MODEL_LEN - 3),
          min_tokens=3, max_tokens=None),
    _case("min_tokens=2**64", REFUSE, min_tokens=2**64),
    # ---- n / best_of --------------------------------------------------------------------------
    _case("n=0", REFUSE, n=0),
    _case("n=-1", REFUSE, n=-1),
    _case("n=1", ACCEPT, n=1),
    _case("n=max_num_seqs", ACCEPT, n=MAX_NUM_SEQS),
    _case("n=max_num_seqs+1", REFUSE, n=MAX_NUM_SEQS + 1),
    _case("n=1000", REFUSE, n=1000),
    _case("n=10**6", REFUSE, n=10**6),
    _case("best_of=0", REFUSE, best_of=0),
    _case("best_of=1", ACCEPT, best_of=1),
    _case("best_of=max_num_seqs", ACCEPT, best_of=MAX_NUM_SEQS),
    _case("best_of=max_num_seqs+1", REFUSE, best_of=MAX_NUM_SEQS + 1),
    _case("best_of=10**6", REFUSE, best_of=10**6),
    _case("best_of<n", REFUSE, n=3, best_of=2),
    _case("best_of=n=max_num_seqs", ACCEPT, n=MAX_NUM_SEQS, best_of=MAX_NUM_SEQS),
    _case("beam n=max_num_seqs", ACCEPT, use_beam_search=True, n=MAX_NUM_SEQS, temperature=0.0),
    _case("beam n=max_num_seqs+1", REFUSE, use_beam_search=True, n=MAX_NUM_SEQS + 1,
          temperature=0.0),
    _case("beam length_penalty=1e308", None, use_beam_search=True, n=2, temperature=0.0,
          length_penalty=1e308, note="a finite length penalty: either answer, never a fault"),
    _case("beam length_penalty=-1e308", None, use_beam_search=True, n=2, temperature=0.0,
          length_penalty=-1e308),
    _case("beam length_penalty=1000, 8 tokens", None, use_beam_search=True, n=2,
          temperature=0.0, length_penalty=1000.0, max_tokens=8, ignore_eos=True,
          note="8.0 ** 1000 overflows a float"),
    # ---- temperature / top_p / top_k / min_p / penalties ---------------------------------------
    _case("temperature=-1", REFUSE, temperature=-1.0),
    _case("temperature=0", ACCEPT, temperature=0.0),
    _case("temperature=1e-6", ACCEPT, temperature=1e-6),
    _case("temperature=1e30", ACCEPT, temperature=1e30),
    _case("temperature=1e308", ACCEPT, temperature=1e308),
    _case("temperature=nan", REFUSE, temperature=NAN),
    _case("temperature=inf", REFUSE, temperature=INF),
    _case("top_p=0", REFUSE, top_p=0.0),
    _case("top_p=1e-9", ACCEPT, top_p=1e-9),
    _case("top_p=1", ACCEPT, top_p=1.0),
    _case("top_p=1.0001", REFUSE, top_p=1.0001),
    _case("top_p=-1", REFUSE, top_p=-1.0),
    _case("top_p=nan", REFUSE, top_p=NAN),
    _case("top_k=-1", ACCEPT, top_k=-1),
    _case("top_k=0", ACCEPT, top_k=0),
    _case("top_k=1", ACCEPT, top_k=1),
    _case("top_k=-2", REFUSE, top_k=-2),
    _case("top_k=vocab+1", ACCEPT, top_k=VOCAB_SIZE + 1),
    _case("top_k=2**31", None, top_k=2**31),
    _case("top_k=2**63", None, top_k=2**63),
    _case("min_p=0", ACCEPT, min_p=0.0),
    _case("min_p=1", ACCEPT, min_p=1.0),
    _case("min_p=-0.1", REFUSE, min_p=-0.1),
    _case("min_p=1.1", REFUSE, min_p=1.1),
    _case("min_p=nan", REFUSE, min_p=NAN),
    _case("presence_penalty=2", ACCEPT, presence_penalty=2.0),
    _case("presence_penalty=2.1", REFUSE, presence_penalty=2.1),
    _case("frequency_penalty=-2", ACCEPT, frequency_penalty=-2.0),
    _case("frequency_penalty=-2.1", REFUSE, frequency_penalty=-2.1),
    _case("repetition_penalty=0", REFUSE, repetition_penalty=0.0),
    _case("repetition_penalty=1e-30", ACCEPT, repetition_penalty=1e-30),
    _case("repetition_penalty=1e30", ACCEPT, repetition_penalty=1e30),
    _case("repetition_penalty=nan", REFUSE, repetition_penalty=NAN),
    # ---- seed -----------------------------------------------------------------------------------
    _case("seed=-1", ACCEPT, seed=-1),
    _case("seed=0", ACCEPT, seed=0),
    _case("seed=-2**63", ACCEPT, seed=-(2**63)),
    _case("seed=2**63-1", ACCEPT, seed=2**63 - 1),
    _case("seed=2**63", None, seed=2**63,
          note="inside the brief's [-2**63, 2**64-1] but outside torch.long: both sides agree"),
    _case("seed=2**64-1", None, seed=2**64 - 1),
    _case("seed=2**64", REFUSE, seed=2**64),
    _case("seed=-2**63-1", REFUSE, seed=-(2**63) - 1),
    _case("seed=-2**64", REFUSE, seed=-(2**64)),
    _case("seed=10**30", REFUSE, seed=10**30),
    # ---- logprobs / prompt_logprobs --------------------------------------------------------------
    _case("logprobs=-1", REFUSE, logprobs=-1,
          note="-1 = the whole vocabulary (49152) > max_logprobs 20"),
    _case("logprobs=0", ACCEPT, logprobs=0),
    _case("logprobs=20", ACCEPT, logprobs=MAX_LOGPROBS),
    _case("logprobs=21", REFUSE, logprobs=MAX_LOGPROBS + 1),
    _case("logprobs=10**9", REFUSE, logprobs=10**9),
    _case("logprobs=-2", REFUSE, logprobs=-2),
    _case("logprobs=True", None, logprobs=True),
    _case("prompt_logprobs=-1", REFUSE, prompt_logprobs=-1),
    _case("prompt_logprobs=0", ACCEPT, prompt_logprobs=0),
    _case("prompt_logprobs=20", ACCEPT, prompt_logprobs=MAX_LOGPROBS),
    _case("prompt_logprobs=21", REFUSE, prompt_logprobs=MAX_LOGPROBS + 1),
    _case("prompt_logprobs=-2", REFUSE, prompt_logprobs=-2),
    # ---- logit_bias ------------------------------------------------------------------------------
    _case("logit_bias=1e30", ACCEPT, logit_bias={5: 1e30}, note="clamped to 100"),
    _case("logit_bias=-1e30", ACCEPT, logit_bias={5: -1e30}),
    _case("logit_bias=1e308 on every token", ACCEPT,
          logit_bias={t: 1e308 for t in range(0, VOCAB_SIZE, 97)}),
    _case("logit_bias last id", ACCEPT, logit_bias={VOCAB_SIZE - 1: 5.0}),
    _case("logit_bias out of vocab", REFUSE, logit_bias={VOCAB_SIZE: 1.0}),
    _case("logit_bias negative id", REFUSE, logit_bias={-1: 1.0}),
    _case("logit_bias key 1.5", REFUSE, logit_bias={"1.5": 1.0}),
    _case("logit_bias key abc", REFUSE, logit_bias={"abc": 1.0}),
    _case("logit_bias value nan", REFUSE, logit_bias={5: NAN}),
    _case("logit_bias 1e5 entries", REFUSE, logit_bias={t: 1.0 for t in range(100_000)},
          note="ids past the vocabulary among them"),
    _case("logit_bias whole vocabulary", ACCEPT, logit_bias={t: -1.0 for t in range(VOCAB_SIZE)}),
    # ---- stop / stop_token_ids / token masks --------------------------------------------------
    _case("stop empty string", REFUSE, stop=""),
    _case("stop list with empty string", REFUSE, stop=["a", ""]),
    _case("stop 1000 entries", ACCEPT, stop=[f"s{i}" for i in range(1000)]),
    _case("stop long string", ACCEPT, stop=["x" * 10_000]),
    _case("stop_token_ids out of vocab", REFUSE, stop_token_ids=[VOCAB_SIZE]),
    _case("stop_token_ids 10**12", REFUSE, stop_token_ids=[10**12]),
    _case("stop_token_ids negative", REFUSE, stop_token_ids=[-1]),
    _case("stop_token_ids=[0]", ACCEPT, stop_token_ids=[0]),
    _case("allowed_token_ids empty", REFUSE, allowed_token_ids=[]),
    _case("allowed_token_ids out of vocab", REFUSE, allowed_token_ids=[VOCAB_SIZE]),
    _case("allowed_token_ids=[5]", ACCEPT, allowed_token_ids=[5]),
    _case("bad_words empty word", REFUSE, bad_words=[""]),
    _case("bad_words", ACCEPT, bad_words=["hello"]),
    # ---- structured outputs ---------------------------------------------------------------------
    _case("structured choice", ACCEPT, structured_outputs={"choice": ["yes", "no"]}),
    _case("structured choice empty", REFUSE, structured_outputs={"choice": []}),
    _case("structured regex invalid", REFUSE, structured_outputs={"regex": "("}),
    _case("structured regex", ACCEPT, structured_outputs={"regex": "[a-z]{1,3}"}),
    _case("structured json schema", ACCEPT, structured_outputs={"json": {"type": "object"}}),
    _case("structured json invalid text", REFUSE, structured_outputs={"json": "{bad"}),
    _case("structured grammar", ACCEPT, structured_outputs={"grammar": 'root ::= "a" | "b"'}),
    _case("structured grammar invalid", REFUSE, structured_outputs={"grammar": "nonsense"}),
    _case("structured two kinds", REFUSE, structured_outputs={"regex": "a", "choice": ["a"]}),
    _case("structured unknown key", REFUSE, structured_outputs={"frobnicate": 1}),
    # ---- prompts ---------------------------------------------------------------------------------
    _case("empty prompt", REFUSE, prompt=""),
    _case("empty token ids", REFUSE, prompt=[]),
    _case("token id = vocab", REFUSE, prompt=[VOCAB_SIZE]),
    _case("token id -1", REFUSE, prompt=[-1]),
    _case("token id 2**64", REFUSE, prompt=[2**64]),
    _case("token id last", ACCEPT, prompt=[VOCAB_SIZE - 1]),
]

assert len({c.id for c in SAMPLING_CASES}) == len(SAMPLING_CASES), "case ids must be unique"
