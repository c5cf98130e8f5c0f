"""Speculative decoding leaves the sampled distribution unchanged (issue 26): a chi-square
goodness-of-fit test of sampled tokens against the exact target distribution, and the same test
rejecting deliberately wrong samplers (a test that cannot fail says nothing).

A tiny random Llama (vocabulary 16, float32, plus a bigram bias towards each token's successor
in the cycle 3, 4, ..., 15) samples 4 tokens at temperature 1 after a prompt that walks the
cycle, n-gram drafts on (k = 2, prompt_lookup 1..2). The first token t1 is drawn at the prefill
(never speculated); then, for every t1 but the 3 special tokens, the proposer has a 2-token
draft (max_tokens = 4 caps it there), accepted in about 40% of the drafted positions: t2, t3,
t4 come from the verification of that draft (accepted drafts, a rejection's own token, the
token after both drafts) or from a later step. 6000 draws: 60 prompts of n = 100 seeded samples.

The exact distribution: transformers' float32 model, every prefix of the tiny vocabulary
enumerated (t4: 4096 contexts in one batched forward), P(t1 .. t4) = p(t1) p(t2|t1) ....
It is a stored reference (tests/references.py), keyed by the checkpoint's bytes and the prompt.

False alarms: each run makes five tests (the marginals of t1, t2, t3, t4 and the joint of
(t2, t3)), each at alpha / 5, alpha = 1e-3 (Bonferroni): a correct sampler fails a run with
probability at most 1e-3. The seeds are fixed (request i has seed SEED0 + i, its samples the
seeds derived from it), so a run is deterministic: the 1e-3 is the probability, over the choice
of seeds, that a correct engine fails. Cells with an expected count under 5 are pooled into one.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.integration.model_fixtures import make_hf_model, save_checkpoint, tiny_config
from tests.references import reference

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

V = 16
ALPHA = 1e-3
N_REQUESTS, N_PER_REQUEST = 60, 100  # n = 100 forks of each prompt: one prefill per 100 draws
N_DRAWS = N_REQUESTS * N_PER_REQUEST
SEED0 = 1000
MAX_TOKENS = 4
SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
PARAMS = dict(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)


# ---- chi-square (no scipy in the environment) ----------------------------------------------

def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square with `df` (integer) degrees of freedom, in closed form:
    even df = 2m: exp(-x/2) sum_{k<m} (x/2)^k / k!; odd df: erfc(sqrt(x/2)) plus
    exp(-x/2) sum_{k=1}^{(df-1)/2} (x/2)^(k-1/2) / Gamma(k+1/2)."""
    if x <= 0:
        return 1.0
    h = x / 2.0
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for k in range(1, df // 2):
            term *= h / k
            total += term
        return math.exp(-h) * total
    total = math.erfc(math.sqrt(h))
    term = math.sqrt(h) / math.gamma(1.5)  # k = 1
    for k in range(1, (df - 1) // 2 + 1):
        if k > 1:
            term *= h / (k - 0.5)
        total += math.exp(-h) * term
    return total


def chisquare(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's statistic of `counts` against `probs` (cells of expected count < 5 pooled),
    its degrees of freedom and p-value."""
    n = float(counts.sum())
    expected = probs.double() * n
    big = expected >= 5.0
    obs = counts.double()[big].tolist()
    exp = expected[big].tolist()
    if (~big).any():
        obs.append(float(counts.double()[~big].sum()))
        exp.append(float(expected[~big].sum()))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    df = len(obs) - 1
    return stat, df, chi2_sf(stat, df)


def test_chi2_sf_matches_known_critical_values():
    # (statistic, df, upper tail): standard table values
    for x, df, p in [(10.828, 1, 1e-3), (13.816, 2, 1e-3), (3.841, 1, 0.05), (24.996, 15, 0.05),
                     (37.697, 15, 1e-3), (30.578, 15, 0.01), (39.252, 16, 1e-3), (18.467, 4, 1e-3)]:
        assert chi2_sf(x, df) == pytest.approx(p, rel=2e-3), (x, df)


# ---- the model and its exact marginals -----------------------------------------------------

def _successor(x: int) -> int:
    return 3 + (x - 2) % (V - 3)  # 3 -> 4 -> ... -> 15 -> 3 (0, 1, 2: the special tokens)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint path, the transformers model, the prompt). A random model plus a bigram
    bias towards each token's successor in the cycle 3, 4, ..., 15, 3, ...: the prompt walks the
    cycle, so the n-gram drafts are the successors, about 40% of them accepted;
    the random attention and MLP keep the distribution dependent on the whole context (and so
    on the cached KV of the drafts)."""
    from benchmarks.gpu_check import save_word_tokenizer

    model = make_hf_model(tiny_config("llama", vocab_size=V), seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, :V] += 2.0 * torch.eye(V)
        for x in range(V):
            model.lm_head.weight[_successor(x), x] += 1.3
    prompt = [3 + i % (V - 3) for i in range(20)]
    path = save_checkpoint(model, tmp_path_factory.mktemp("spec-dist"))
    save_word_tokenizer(V, path)
    return str(path), model, prompt


@pytest.fixture(scope="module")
def joint(tiny):
    """The exact joint distribution of output tokens 1..4, [V, V, V, V] (float64): one batched
    forward per position over every prefix of the tokens before it (stored)."""
    path, model, prompt = tiny

    @torch.no_grad()
    def compute():
        joint = torch.ones(())
        prefixes = torch.tensor([prompt])
        for j in range(MAX_TOKENS):
            probs = model(prefixes).logits[:, -1].double().softmax(-1)  # [V^j, V]
            joint = (joint.reshape(-1, 1) * probs).reshape((V,) * (j + 1))
            if j + 1 < MAX_TOKENS:
                n = prefixes.shape[0]
                prefixes = torch.cat([prefixes.repeat_interleave(V, 0),
                                      torch.arange(V).repeat(n).unsqueeze(1)], dim=1)
        return joint

    joint = torch.tensor(reference("spec_decode_distribution.joint", compute, sources=[path],
                                   inputs={"prompt": prompt, "max_tokens": MAX_TOKENS}), dtype=torch.float64)
    assert joint.shape == (V,) * MAX_TOKENS
    assert float(joint.sum()) == pytest.approx(1.0, abs=1e-9)
    return joint


@pytest.fixture(scope="module")
def spec_llm(tiny):
    """One thread and torch's matmuls: the tiny shapes are fastest so (exactness is the same)."""
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_KERNEL_CHOICE", "torch")
        llm = LLM(tiny[0], speculative_config=SPEC, num_kv_blocks=1024, max_model_len=64,
                  num_threads=1)
    yield llm
    torch.set_num_threads(threads)


def _draw(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """N_DRAWS seeded samples of MAX_TOKENS tokens: [N, MAX_TOKENS] and the (drafts, accepted)
    counts of the run."""
    core = llm.llm_engine.core
    before = (core.speculation.stats.num_draft_tokens, core.speculation.stats.num_accepted_tokens)
    params = [SamplingParams(n=N_PER_REQUEST, seed=SEED0 + i, **PARAMS) for i in range(N_REQUESTS)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * N_REQUESTS, params, use_tqdm=False)
    tokens = torch.tensor([c.token_ids for o in outs for c in o.outputs])
    assert tokens.shape == (N_DRAWS, MAX_TOKENS)
    assert llm.kv_cache_stats().used_blocks == 0
    st = core.speculation.stats
    return tokens, (st.num_draft_tokens - before[0], st.num_accepted_tokens - before[1])


# What is tested, each at ALPHA / 5: the marginals of t1 (drawn at the prefill, never
# speculated: a control), t2, t3, t4 and the joint of (t2, t3).
CHECKS = ("t1", "t2", "t3", "t4", "(t2,t3)")


def _fit(tokens: torch.Tensor, joint: torch.Tensor) -> dict[str, tuple[float, int, float]]:
    """check -> (statistic, degrees of freedom, p-value)."""
    def marginal(*positions: int) -> torch.Tensor:
        others = tuple(d for d in range(MAX_TOKENS) if d not in positions)
        return joint.sum(dim=others).reshape(-1) if others else joint.reshape(-1)

    def counts(*positions: int) -> torch.Tensor:
        flat = torch.zeros(tokens.shape[0], dtype=torch.long)
        for p in positions:
            flat = flat * V + tokens[:, p]
        return torch.bincount(flat, minlength=V ** len(positions))

    cells = {"t1": (0,), "t2": (1,), "t3": (2,), "t4": (3,), "(t2,t3)": (1, 2)}
    return {name: chisquare(counts(*cells[name]), marginal(*cells[name]))
            for name in CHECKS}


def _show(res: dict) -> str:
    return ", ".join(f"{k}: chi2={s:.1f} df={d} p={p:.3g}" for k, (s, d, p) in res.items())


def test_sampled_tokens_follow_the_target_distribution(spec_llm, tiny, joint):
    tokens, (drafted, accepted) = _draw(spec_llm, tiny[2])
    # drafts were made and both outcomes of the verification happened often
    assert drafted >= N_DRAWS and 0.2 * drafted < accepted < 0.8 * drafted, (drafted, accepted)
    res = _fit(tokens, joint)
    print(f"\nright sampler ({drafted} drafted, {accepted} accepted): {_show(res)}")
    for name in CHECKS:
        stat, df, p = res[name]
        assert p > ALPHA / len(CHECKS), f"{name}: chi2={stat:.1f} df={df} p={p:.2e}"


def _accept_every_draft(drawn, spans):
    """A wrong verifier: every draft is kept as if the target had drawn it."""
    keep, accepted = [], []
    for first, drafts in spans:
        drawn[first: first + len(drafts)] = drafts
        keep.extend(range(first, first + len(drafts) + 1))
        accepted.append(len(drafts))
    return keep, accepted


@pytest.mark.parametrize("wrong", ["accept_every_draft", "keep_every_draw"])
def test_the_test_rejects_a_wrong_sampler(spec_llm, tiny, joint, monkeypatch, wrong):
    """accept_every_draft: each draft is emitted unconditionally (no rejection test).
    keep_every_draw: accepted_prefix says every draft matched, so the tokens drawn after a
    rejected draft (conditioned on it) are emitted too."""
    if wrong == "accept_every_draft":
        monkeypatch.setattr("pagedllm.worker.step_sampling.rows_to_keep", _accept_every_draft)
    else:
        monkeypatch.setattr("pagedllm.spec_decode.verify.accepted_prefix", lambda drawn, drafts: len(drafts))
    tokens, (drafted, accepted) = _draw(spec_llm, tiny[2])
    assert drafted >= N_DRAWS and accepted == drafted
    res = _fit(tokens, joint)
    print(f"\n{wrong}: {_show(res)}")
    assert min(res[name][2] for name in CHECKS) < ALPHA / len(CHECKS), _show(res)


def test_the_plain_engine_passes_the_same_test(tiny, joint):
    """A control of the reference and of the test itself: the same draws without speculation."""
    threads = torch.get_num_threads()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PAGEDLLM_KERNEL_CHOICE", "torch")
            llm = LLM(tiny[0], num_kv_blocks=1024, max_model_len=64, num_threads=1)
        params = [SamplingParams(n=N_PER_REQUEST, seed=SEED0 + i, **PARAMS) for i in range(N_REQUESTS)]
        outs = llm.generate([{"prompt_token_ids": tiny[2]}] * N_REQUESTS, params, use_tqdm=False)
        res = _fit(torch.tensor([c.token_ids for o in outs for c in o.outputs]), joint)
        print(f"\nplain engine: {_show(res)}")
        for name in CHECKS:
            assert res[name][2] > ALPHA / len(CHECKS), _show(res)
    finally:
        torch.set_num_threads(threads)
