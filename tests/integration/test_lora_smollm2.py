"""LoRA on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF: the base layers stay on the
integer kernels, the adapters float32): an adapter trained by peft for 60 steps (24-token windows)
on the shipped held-out text (its greedy output visibly differs from the base) and a random one on all seven
projections; greedy output equals peft's PeftModel over transformers' float32 copy of the same
GGUF, alone and mixed with the base in one batch; prompt logprobs agree."""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.integration.lora_fixtures import greedy, prompt_logprobs
from tests.smollm2 import hf_tokenizer

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier

PROMPTS = ["The history of the city begins", "Photosynthesis is the process by which",
           "def add(a, b):"]
MAX_TOKENS = 12


def _fresh_smollm2(hf_smollm2):
    """A copy of the session's transformers SmolLM2 for peft to wrap (peft changes the model it
    wraps; a copy costs a fraction of a second, a second load of the GGUF many seconds)."""
    return copy.deepcopy(hf_smollm2)


def _heldout_ids(tok) -> list[int]:
    text = resources.files("pagedllm.data").joinpath("heldout.txt").read_text(encoding="utf-8")
    return tok.encode(re.split(r"\n-{3,}\n", text)[0])


TRAINED = "smollm2-qv-r8-60x24-v2"  # the recipe below; change the name when it changes
TRAIN_STEPS = 60  # enough to change greedy output visibly; 200 took a clean CI machine a minute


def _trained_adapter(smollm2_gguf: str, hf_smollm2, cache: Path):
    """The adapter trained by peft (q/v, r=8, TRAIN_STEPS AdamW steps on 24-token windows of the
    held-out text), trained once per machine (about 20 s on 2 cores) and kept under the
    pagedllm cache folder like the kernels; its peft model over a fresh float32 SmolLM2."""
    from peft import LoraConfig, PeftModel, get_peft_model

    path = cache / TRAINED
    if (path / "adapter_model.safetensors").exists():
        return path, PeftModel.from_pretrained(_fresh_smollm2(hf_smollm2), path).eval()
    ids = _heldout_ids(hf_tokenizer(smollm2_gguf))
    torch.manual_seed(0)
    model = get_peft_model(_fresh_smollm2(hf_smollm2), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                                      target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(TRAIN_STEPS):
        start = int(torch.randint(0, len(ids) - 25, (1,), generator=gen))
        window = torch.tensor([ids[start:start + 24]])
        model(window, labels=window).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{TRAINED}-"))
    model.save_pretrained(tmp)
    try:
        os.replace(tmp, path)  # atomic: a concurrent run keeps its own or finds this one
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return path, model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, smollm2_gguf, hf_smollm2):
    """name -> (folder, peft model): `trained` (see `_trained_adapter`) and `random` (all seven
    projections, r=16, random B)."""
    from peft import LoraConfig, get_peft_model

    from pagedllm.model_source import cache_dir

    cache = Path(cache_dir()) / "test-adapters"
    cache.mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("lora-smollm2")
    out = {"trained": _trained_adapter(smollm2_gguf, hf_smollm2, cache)}
    torch.manual_seed(1)
    rnd = get_peft_model(_fresh_smollm2(hf_smollm2), LoraConfig(
        r=16, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in rnd.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.02)
    rnd.eval()
    rnd.save_pretrained(root / "random")
    out["random"] = (root / "random", rnd)
    return out


def test_smollm2_adapters_equal_peft_alone_and_mixed(adapters, hf_smollm2, smollm2_gguf):
    llm = LLM(smollm2_gguf, enable_lora=True, max_loras=2, max_lora_rank=16, kv_cache_space=0.25, max_model_len=512)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    loras = {name: LoRARequest(name, i + 1, str(path)) for i, (name, (path, _)) in enumerate(adapters.items())}
    want = {None: [greedy(hf_smollm2, p, MAX_TOKENS) for p in ids]}
    for name, (_, model) in adapters.items():
        want[name] = [greedy(model, p, MAX_TOKENS) for p in ids]
    assert want["trained"] != want[None]  # the trained adapter visibly changes the output
    names = [None, "trained", "random"]
    jobs = [(n, i) for n in names for i in range(len(ids))]  # every adapter and the base in one batch
    outs = llm.generate([{"prompt_token_ids": ids[i]} for _, i in jobs],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False, lora_request=[None if n is None else loras[n] for n, _ in jobs])
    worst = 0.0
    for (name, i), out in zip(jobs, outs):
        assert list(out.outputs[0].token_ids) == want[name][i], (name, PROMPTS[i])
        model = hf_smollm2 if name is None else adapters[name][1]
        got = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[i][1:])])
        worst = max(worst, float((got - prompt_logprobs(model, ids[i])).abs().max()))
    print(f"SmolLM2 LoRA parity: prompt logprobs max |engine - peft| = {worst:.2e}")
    assert worst < 1e-3
