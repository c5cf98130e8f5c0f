"""`pagedllm serve` on an architecture pagedllm cannot run exits 2 before any engine core
starts, with the error that names it and lists what each runner (generate / pooling) supports
(model/resolution.py). Real processes, folders saved by transformers' own classes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.server.helpers import free_port

pytestmark = pytest.mark.slow  # starts server processes: not in the quick `not slow` tier

SUPPORTED_LISTS = "Supported architectures: generate: ['LlamaForCausalLM'"


def _serve(entry: str, model: str, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", *entry.split(), "--model", model, "--host", "127.0.0.1",
                           "--port", str(free_port()), *flags], capture_output=True, text=True, timeout=180, env=env)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory) -> str:
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("entry,flags", [("pagedllm.entrypoints.cli serve", ()),
                                         ("pagedllm.entrypoints.cli serve", ("--runner", "generate")),
                                         ("pagedllm.entrypoints.openai.api_server", ())])
def test_serve_on_an_unsupported_architecture_exits_2_naming_it(gpt2_folder, entry, flags):
    proc = _serve(entry, gpt2_folder, *flags)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: Model architecture(s) ['GPT2LMHeadModel'] are not supported by pagedllm.")
    assert SUPPORTED_LISTS in line and "; pooling: ['BertModel'" in line
    assert "EngineCore" not in proc.stderr and "Traceback" not in proc.stderr  # refused before any core


def test_serve_on_an_unsupported_multimodal_model_exits_2_naming_it(tmp_path):
    from transformers import GemmaConfig, PaliGemmaConfig, SiglipVisionConfig

    text = GemmaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = PaliGemmaConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
    config.architectures = ["PaliGemmaForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    proc = _serve("pagedllm.entrypoints.cli serve", str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: Model architecture(s) ['PaliGemmaForConditionalGeneration'] are not supported" in proc.stderr
    assert "vocab_size" not in proc.stderr
