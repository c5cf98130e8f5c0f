"""`pagedllm serve` launches its engine cores before it imports torch and transformers (about 3 s
on 2 cores; entrypoints/openai/serve_start.py): the two start-ups overlap."""

from __future__ import annotations

import subprocess
import sys

_BEFORE_THE_CORES = ("pagedllm.entrypoints.cli", "pagedllm.entrypoints.openai.serve_start",
                     "pagedllm.engine.core_start", "pagedllm.engine.core_client",
                     "pagedllm.model.resolution", "pagedllm.entrypoints.arg_utils",
                     "pagedllm.entrypoints.openai.lora_models",
                     "pagedllm.entrypoints.openai.tool_calling", "pagedllm.config",
                     "pagedllm.model_source")


def test_what_runs_before_the_cores_launch_imports_nothing_heavy():
    code = (f"import sys\nimport {', '.join(_BEFORE_THE_CORES)}\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_serving_runner_reads_architectures_from_config_json(tmp_path):
    from pagedllm.config import EngineConfig
    from pagedllm.model.resolution import serving_runner

    for archs, runner in ((["BertModel"], "pooling"), (["LlamaForCausalLM"], "generate"),
                          (["Qwen2Model"], "pooling")):
        (tmp_path / "config.json").write_text(
            '{"architectures": %s, "model_type": "x"}' % str(archs).replace("'", '"'))
        assert serving_runner(EngineConfig(model=str(tmp_path))) == runner


def test_the_serving_runner_imports_nothing_heavy(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3Model"], "model_type": "qwen3"}')
    code = ("import sys\nfrom pagedllm.config import EngineConfig\nfrom pagedllm.model.resolution import serving_runner\n"
            f"print(serving_runner(EngineConfig(model={str(tmp_path)!r})), "
            "sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "pooling []"
