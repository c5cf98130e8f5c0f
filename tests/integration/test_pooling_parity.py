"""Pooling models against sentence-transformers and transformers on tiny random float32
checkpoints (docs/pooling.md's parity table): embeddings cosine >= 0.99999 and max-abs <=
1e-4, cross-encoder scores equal to `CrossEncoder.predict` within 1e-4 with the same order,
Matryoshka truncation and normalisation as sentence-transformers does them.

The reference libraries' outputs are stored (tests/references.py, `pooling_parity.*`) and compared
with our engine as strictly as before; three are computed live every run, each reference
library's check that the store has not drifted: sentence-transformers' `encode`
(bert-mean-dense-prompt), its `CrossEncoder.predict` (ce-bert) and transformers' plain hidden
states (the architecture default)."""

from __future__ import annotations

import pytest
import torch

from tests.integration.pooling_fixtures import save_decoder_embedder, save_encoder
from tests.references import reference

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

st = pytest.importorskip("sentence_transformers")

TEXTS = [
    "the capital of france is paris",
    "a cat and a dog",
    "what is the memory cache of the engine",
    "one two three four five six seven eight nine ten one two three four five six seven eight nine ten "
    "red blue green small large fast slow the river of the city",
    "x",
]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat is on the tree", "a small blue book", "music of the city",
        "the engine has a cache"]
ST_LIBS = ("transformers", "sentence-transformers")
# Stored against live: recomputed on other float32 paths (one thread, oneDNN off) these references
# moved by at most 2.2e-7 (relative, at least absolute), as another CPU's rounding would; TOLERANCE is
# 50 times that and a tenth of the tests' 1e-4, TIGHT a fifth of the architecture-default test's 1e-5.
TOLERANCE = 1e-5
TIGHT = 2e-6


def _st_model(hf_folder, out_folder, pooling: str, dense: int | None = None, normalize: bool = True,
              prompt: str | None = None):
    """A sentence-transformers folder over a transformers one (Transformer, Pooling, optional
    Dense and Normalize, an optional default prompt)."""
    from sentence_transformers import SentenceTransformer, models

    torch.manual_seed(7)
    t = models.Transformer(str(hf_folder))
    mods = [t, models.Pooling(t.get_word_embedding_dimension(), pooling)]
    if dense:
        mods.append(models.Dense(t.get_word_embedding_dimension(), dense))
    if normalize:
        mods.append(models.Normalize())
    kwargs = dict(prompts={"query": prompt}, default_prompt_name="query") if prompt else {}
    model = SentenceTransformer(modules=mods, device="cpu", **kwargs)
    model.save(str(out_folder))
    return model


def _compare(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1).min().item()
    return cos, (ours - ref).abs().max().item()


def _embed(llm, texts, **params):
    from pagedllm import PoolingParams

    outs = llm.embed(texts, PoolingParams(**params) if params else None, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling")
    save_encoder(root / "bert")
    save_encoder(root / "xlmr", arch="xlm-roberta", seed=1)
    save_decoder_embedder(root / "qwen3", "qwen3", seed=2)
    save_decoder_embedder(root / "llama", "llama", seed=3)
    save_encoder(root / "ce-bert", classifier_labels=1, seed=4)
    save_encoder(root / "ce-xlmr", arch="xlm-roberta", classifier_labels=1, seed=5)
    return root


CASES = [
    # (name, hf folder, sentence-transformers pooling, dense, normalize, prompt, engine kwargs)
    ("bert-mean-dense-prompt", "bert", "mean", 32, True, "query: ", {}),
    ("xlmr-cls", "xlmr", "cls", None, True, None, {}),
    ("qwen3-last", "qwen3", "lasttoken", None, True, None, {}),
    # mean pooling over chunked prefills (8-token chunks): every chunk's rows count
    ("llama-mean-chunked", "llama", "mean", None, False, None, {"max_num_batched_tokens": 8}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_embeddings_match_sentence_transformers(folders, tmp_path, case):
    from pagedllm import LLM

    name, hf, pooling, dense, normalize, prompt, kwargs = case
    ref_model = _st_model(folders / hf, tmp_path / name, pooling, dense, normalize, prompt)  # the engine's folder
    refs = reference(f"pooling_parity.st_embed.{name}",
                     lambda: {"full": ref_model.encode(TEXTS, convert_to_numpy=True),
                              "truncate_dim_16": ref_model.encode(TEXTS, truncate_dim=16, normalize_embeddings=True)},
                     sources=[tmp_path / name], inputs={"texts": TEXTS, "truncate_dim": 16}, libs=ST_LIBS,
                     live=name == "bert-mean-dense-prompt", tolerance=TOLERANCE)
    ref = torch.tensor(refs["full"])
    llm = LLM(str(tmp_path / name), runner="pooling", num_kv_blocks=64, **kwargs)
    ours = _embed(llm, TEXTS)
    cos, max_abs = _compare(ours, ref)
    print(f"PARITY {name}: min cosine {cos:.8f}, max abs {max_abs:.2e}")
    assert cos >= 0.99999 and max_abs <= 1e-4, (cos, max_abs)
    # Matryoshka: truncate, then normalise (encode(truncate_dim=16, normalize_embeddings=True))
    ref16 = torch.tensor(refs["truncate_dim_16"])
    ours16 = _embed(llm, TEXTS, dimensions=16, normalize=True)
    assert ours16.shape == (len(TEXTS), 16)
    cos16, abs16 = _compare(ours16, ref16)
    print(f"PARITY {name} dimensions=16: min cosine {cos16:.8f}, max abs {abs16:.2e}")
    assert cos16 >= 0.99999 and abs16 <= 1e-4


def test_architecture_default_without_sentence_transformers_files(folders):
    """No modules.json: BERT embeds by its [CLS] state, normalised (vLLM's default); a
    --pooler-config of MEAN / no normalisation is honoured."""
    from transformers import AutoModel, AutoTokenizer

    from pagedllm import LLM

    def hf_pooled():
        tok = AutoTokenizer.from_pretrained(folders / "bert")
        hf = AutoModel.from_pretrained(folders / "bert").eval()
        with torch.no_grad():
            states = [hf(**tok(t, return_tensors="pt")).last_hidden_state[0] for t in TEXTS]
        return {"cls_normalized": torch.nn.functional.normalize(torch.stack([s[0] for s in states]), dim=-1),
                "mean": torch.stack([s.mean(0) for s in states])}

    refs = reference("pooling_parity.bert_default_pooling", hf_pooled, sources=[folders / "bert"],
                     inputs={"texts": TEXTS}, live=True, tolerance=TIGHT)
    cls_ref = torch.tensor(refs["cls_normalized"])
    assert _compare(_embed(LLM(str(folders / "bert")), TEXTS), cls_ref)[1] <= 1e-5
    mean_ref = torch.tensor(refs["mean"])
    llm = LLM(str(folders / "bert"), pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    assert _compare(_embed(llm, TEXTS), mean_ref)[1] <= 1e-5


@pytest.mark.parametrize("ce", ["ce-bert", "ce-xlmr"])
def test_rerank_scores_match_cross_encoder(folders, ce):
    from sentence_transformers import CrossEncoder

    from pagedllm import LLM

    ref = reference(f"pooling_parity.cross_encoder.{ce}",
                    lambda: CrossEncoder(str(folders / ce), device="cpu").predict([(QUERY, d) for d in DOCS]),
                    sources=[folders / ce], inputs={"query": QUERY, "documents": DOCS}, libs=ST_LIBS,
                    live=ce == "ce-bert", tolerance=TOLERANCE)
    llm = LLM(str(folders / ce), task="score")
    ours = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    diff = max(abs(a - float(b)) for a, b in zip(ours, ref))
    print(f"PARITY {ce}: max |score - CrossEncoder.predict| {diff:.2e}")
    assert diff <= 1e-4
    assert sorted(range(len(DOCS)), key=lambda i: -ours[i]) == sorted(range(len(DOCS)), key=lambda i: -ref[i])
    probs = llm.classify(DOCS, use_tqdm=False)
    assert all(len(p.outputs.probs) == 1 and 0 < p.outputs.probs[0] < 1 for p in probs)


def test_prefix_cache_serves_shared_prefix_of_last_token_embedder(folders):
    """Last-token pooling through the paged engine: a second batch sharing a long prefix hits
    the prefix cache and gives the same embeddings as a cold engine."""
    from pagedllm import LLM

    prefix = "the capital of france is paris and the river of the city " * 3
    texts = [prefix + t for t in TEXTS]
    warm = LLM(str(folders / "qwen3"), runner="pooling", num_kv_blocks=64, block_size=8)
    warm.embed(texts[:1], use_tqdm=False)
    hits_before = warm.llm_engine.core.kv_cache_manager.prefix_cache_hits
    got = _embed(warm, texts)
    assert warm.llm_engine.core.kv_cache_manager.prefix_cache_hits > hits_before
    cold = _embed(LLM(str(folders / "qwen3"), runner="pooling", num_kv_blocks=64, block_size=8,
                      enable_prefix_caching=False), texts)
    assert (got - cold).abs().max().item() <= 1e-5


def test_offline_refusals_are_value_errors_and_lose_nothing(folders):
    """Bad input to a pooling LLM is a ValueError naming what is wrong; the engine keeps
    nothing of it and serves the next call."""
    from pagedllm import LLM, PoolingParams, SamplingParams

    llm = LLM(str(folders / "qwen3"), runner="pooling", num_kv_blocks=64, max_model_len=32)
    for call, match in [
        (lambda: llm.generate("hi", SamplingParams()), "pooling model"),
        (lambda: llm.classify(["hi"]), "classify"),
        (lambda: llm.embed([]), "empty"),
        (lambda: llm.embed(["ok", "paris " * 100]), "maximum context length"),
        (lambda: llm.embed(["ok"], PoolingParams(dimensions=65)), "dimensions"),
        (lambda: llm.embed([{"prompt_token_ids": [1, 10**6]}]), "prompt token id"),
        (lambda: llm.embed([3.5]), "prompt"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
        assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.core.kv_cache_manager.num_free_blocks == 64
    out = llm.embed(["paris " * 100], truncate_prompt_tokens=16, use_tqdm=False)
    assert out[0].num_prompt_tokens == 16 and len(out[0].outputs.embedding) == 64
    ce = LLM(str(folders / "ce-bert"))
    with pytest.raises(ValueError, match="embed"):
        ce.embed(["hi"])
    gguf = folders / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="GGUF"):
        LLM(str(gguf), runner="pooling")


def test_hub_id_resolves_sentence_transformers_folder(folders, tmp_path, monkeypatch):
    """A Hub id in a cache laid out as huggingface_hub lays it out (offline) loads as the
    folder does, sentence-transformers' Pooling / Dense / Normalize / prompt included; the
    Hub download asks for those files."""
    from huggingface_hub import constants

    from pagedllm import LLM
    from pagedllm.hub import _choose_files
    from tests.hub_cache import add_folder, commit_hash

    folder = tmp_path / "st"
    st_model = _st_model(folders / "bert", folder, "mean", 32, True, "query: ")
    ref = reference("pooling_parity.hub_st_embed", lambda: st_model.encode(TEXTS), sources=[folder],
                    inputs={"texts": TEXTS}, libs=ST_LIBS, tolerance=TOLERANCE)
    cache = tmp_path / "hub"
    add_folder(cache, "org/tiny-st-embed", commit_hash("st-v1"), folder)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llm = LLM("org/tiny-st-embed", download_dir=str(cache))
    assert llm.llm_engine.pooling_inputs.pooler.source == "sentence-transformers"
    got = _embed(llm, TEXTS)
    assert _compare(got, torch.tensor(ref))[1] <= 1e-4
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    _, patterns = _choose_files("org/tiny-st-embed", files, None, None, weights=True)
    import fnmatch

    for needed in ("modules.json", "1_Pooling/config.json", "2_Dense/config.json", "2_Dense/model.safetensors",
                   "config_sentence_transformers.json"):
        assert any(fnmatch.fnmatch(needed, p) for p in patterns), needed


def test_headless_decoder_cannot_generate(folders):
    """A `Qwen3Model` folder has no LM head: the generation runner refuses it by name."""
    from pagedllm import LLM

    with pytest.raises(ValueError, match="no LM head"):
        LLM(str(folders / "qwen3"), runner="generate", num_kv_blocks=16)
