"""Models loaded by Hub id from a Hugging Face cache laid out as huggingface_hub writes it
(tests/hub_cache.py), offline: the same greedy tokens as loading the folder itself, per
revision; GGUF files by quantization tag; tokenizer ids; the environment's HF_HOME /
HF_HUB_CACHE; `pagedllm serve org/name`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.model_source import resolve_model
from tests.hub_cache import add_folder, add_revision, commit_hash
from tests.integration.arch_parity import build_tiny

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

MAIN, V1 = commit_hash("tiny main"), commit_hash("tiny v1")
PROMPTS = [[5, 6, 7, 8], [100, 200, 300, 400, 500]]
LLM_KW = dict(num_kv_blocks=64, max_model_len=256, enable_prefix_caching=False)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


def _word_tokenizer(path: Path, prefix: str, vocab_size: int = 1000) -> None:
    """A word-level tokenizer whose tokens are `<prefix><id>`: which one decoded is visible."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2} | {f"{prefix}{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                            eos_token="<eos>").save_pretrained(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Two tiny random Llama checkpoints (different weights) and a tokenizer of other words."""
    root = tmp_path_factory.mktemp("tiny")
    build_tiny(_tiny_config(), root / "a", seed=0)
    build_tiny(_tiny_config(), root / "b", seed=1)
    _word_tokenizer(root / "w", "w")
    return {"a": root / "a", "b": root / "b", "w": root / "w"}


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, folders, smollm2_gguf) -> Path:
    home = tmp_path_factory.mktemp("hf_home")
    cache = home / "hub"
    add_folder(cache, "org/tiny", MAIN, folders["a"])
    add_folder(cache, "org/tiny", V1, folders["b"], refs=("v1",))
    add_revision(cache, "org/tiny-tok", MAIN, {f: folders["a"] / f for f in TOKENIZER_FILES})
    add_revision(cache, "org/tiny-tok", V1, {f: folders["w"] / f for f in TOKENIZER_FILES}, refs=("v1",))
    add_revision(cache, "org/SmolLM2-GGUF", MAIN, {Path(smollm2_gguf).name: Path(smollm2_gguf)})
    return home


@pytest.fixture(autouse=True)
def offline_cache(hf_home, monkeypatch):
    """huggingface_hub's cache is `hf_home/hub`, offline whatever the environment says."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _greedy(model: str, prompts=PROMPTS, **kwargs) -> tuple[list[list[int]], list[str], str]:
    """(token ids, texts, the engine's model name) of 8 greedy tokens per prompt."""
    llm = LLM(model, **(LLM_KW | kwargs))
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        name = llm.llm_engine.model_name
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs], name


@pytest.fixture(scope="module")
def by_path(folders) -> dict[str, list[list[int]]]:
    return {k: _greedy(str(folders[k]))[0] for k in ("a", "b")}


def test_id_loads_as_its_folder(by_path):
    ids, texts, name = _greedy("org/tiny")
    assert ids == by_path["a"] and name == "org/tiny"
    assert texts[0].split() == [f"t{t}" for t in ids[0]]  # the repo's own tokenizer


def test_revisions_load_their_own_weights(by_path, hf_home):
    assert by_path["a"] != by_path["b"]  # otherwise the test below could not fail
    assert _greedy("org/tiny", revision="v1")[0] == by_path["b"]


def test_commit_revision_from_download_dir(by_path, hf_home, tmp_path, monkeypatch):
    """download_dir replaces huggingface_hub's cache (pointed at an empty folder here)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=f"cache dir {tmp_path / 'empty'}"):
        LLM("org/tiny", **LLM_KW)
    ids, _, _ = _greedy("org/tiny", revision=V1, download_dir=str(hf_home / "hub"))
    assert ids == by_path["b"]


def test_tokenizer_id_at_a_revision(by_path, folders):
    """Weights from the folder, tokenizer from `org/tiny-tok` at v1 (other words): the same
    tokens, decoded by the id's tokenizer."""
    ids, texts, _ = _greedy(str(folders["a"]), tokenizer="org/tiny-tok", tokenizer_revision="v1")
    assert ids == by_path["a"]
    assert texts[0].split() == [f"w{t}" for t in ids[0]]


def test_gguf_by_quant_tag(smollm2_llm, smollm2_gguf):
    """`org/name:TAG` (any case) and `gguf_file=` pick the repo's GGUF; greedy as the file."""
    name = Path(smollm2_gguf).name
    snapshot = Path(resolve_model("org/SmolLM2-GGUF:Q4_1").path)
    assert resolve_model("org/SmolLM2-GGUF:q4_1").gguf_file == name
    assert resolve_model("org/SmolLM2-GGUF", gguf_file=name).path == str(snapshot)
    assert resolve_model("org/SmolLM2-GGUF").gguf_file == name  # the repo's only GGUF
    prompt = smollm2_llm.get_tokenizer().encode("The capital of France is")
    expected = smollm2_llm.generate([{"prompt_token_ids": prompt}],
                                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].token_ids
    ids, _, served = _greedy("org/SmolLM2-GGUF:Q4_1", prompts=[prompt], kv_cache_space=0.2,
                             num_kv_blocks=None, max_model_len=512)
    assert ids == [expected] and served == "org/SmolLM2-GGUF:Q4_1"


def _resolve_in_subprocess(env: dict[str, str], model: str = "org/tiny") -> subprocess.CompletedProcess:
    code = f"from pagedllm.model_source import resolve_model; print(resolve_model({model!r}).path)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_HUB_OFFLINE": "1"} | env
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_environment_names_the_cache(hf_home, tmp_path):
    """huggingface_hub reads HF_HOME / HF_HUB_CACHE itself; nothing of ours bypasses them."""
    proc = _resolve_in_subprocess({"HF_HOME": str(hf_home)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(hf_home / "hub" / "models--org--tiny" / "snapshots" / MAIN)
    proc = _resolve_in_subprocess({"HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(hf_home / "hub")})
    assert proc.returncode == 0 and proc.stdout.strip().startswith(str(hf_home / "hub")), proc.stderr
    proc = _resolve_in_subprocess({"HF_HOME": str(tmp_path)})
    assert proc.returncode != 0
    assert f"is not in the Hugging Face cache (looked in {tmp_path / 'hub' / 'models--org--tiny'}" in proc.stderr


def test_serve_an_id(hf_home, tmp_path, by_path):
    """`pagedllm serve org/name`: a missing id fails at start-up naming the cache; a cached one
    serves under its id (the core process resolves the same pinned commit)."""
    import httpx

    from tests.server.conftest import serving

    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "org/absent",
                           "--port", "0"], env=env | {"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"error: Model 'org/absent' (revision 'main') is not in the Hugging Face cache " \
           f"(looked in {tmp_path / 'hub' / 'models--org--absent'}" in proc.stderr
    with serving(["-m", "pagedllm.entrypoints.cli", "serve", "org/tiny", "--revision", "v1",
                  "--num-kv-blocks", "64", "--max-model-len", "256"]) as srv:
        models = httpx.get(f"{srv.url}/v1/models", headers=srv.headers, timeout=30).json()
        assert [m["id"] for m in models["data"]] == ["org/tiny"]
        r = httpx.post(f"{srv.url}/v1/completions", headers=srv.headers, timeout=60,
                       json={"model": "org/tiny", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "org/tiny", r.text
        # v1's weights in the core process, v1's tokenizer in the front end
        assert r.json()["choices"][0]["text"].split() == [f"t{t}" for t in by_path["b"][0][:4]]
