"""PoolingParams validation, --pooler-config parsing, sentence-transformers folders (both
Pooling config formats, Dense, Normalize, prompts, refusals by name) and the poolers'
arithmetic, without a model."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.pooler_config import PoolerConfig, load_pooler_config, parse_override
from pagedllm.pooling.poolers import check_dimensions, classifier_output, finish_embedding, pool


@pytest.mark.parametrize("kwargs,field", [
    ({"dimensions": 0}, "dimensions"), ({"dimensions": True}, "dimensions"), ({"dimensions": "8"}, "dimensions"),
    ({"normalize": 1}, "normalize"), ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"), ({"task": "generate"}, "task"),
])
def test_pooling_params_refuse_bad_values_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PoolingParams(**kwargs)


def test_pooling_params_accept_vllm_values():
    p = PoolingParams(dimensions=8, normalize=False, truncate_prompt_tokens=-1, task="embed")
    assert p.clone(dimensions=4).dimensions == 4 and p.dimensions == 8


@pytest.mark.parametrize("override,match", [
    ('{"pooling_type": "MAX"}', "pooling_type"), ('{"softmax": true}', "softmax"), ("[1]", "JSON object"),
    ("{not json", "JSON"), ({"normalize": "yes"}, "normalize"), ({"dimensions": -1}, "dimensions"),
])
def test_pooler_config_override_refused_by_name(override, match):
    with pytest.raises(ValueError, match=match):
        parse_override(override)
    with pytest.raises(ValueError, match=match):
        EngineConfig(pooler_config=override)


def test_runner_and_task_knobs():
    assert EngineConfig(task="embed").requested_runner == "pooling"
    assert EngineConfig(runner="pooling").requested_runner == "pooling"
    assert EngineConfig(task="generate").requested_runner == "generate"
    with pytest.raises(ValueError, match="runner"):
        EngineConfig(runner="embedding")
    with pytest.raises(ValueError, match="task"):
        EngineConfig(task="reward")
    with pytest.raises(ValueError, match="task='embed'"):
        EngineConfig(task="embed", runner="generate")


def _write(folder, name, data):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _st_folder(tmp_path, pooling: dict, extra_modules=(), prompts=None):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               *extra_modules]
    _write(tmp_path, "modules.json", modules)
    _write(tmp_path, "1_Pooling/config.json", pooling)
    _write(tmp_path, "sentence_bert_config.json", {"max_seq_length": 77, "do_lower_case": True})
    if prompts:
        _write(tmp_path, "config_sentence_transformers.json", prompts)
    return str(tmp_path)


def test_sentence_transformers_v2_pooling_format(tmp_path):
    folder = _st_folder(tmp_path, {"word_embedding_dimension": 8, "pooling_mode_cls_token": False,
                                   "pooling_mode_mean_tokens": True})
    cfg = load_pooler_config(folder, is_encoder=True)
    assert (cfg.pooling_type, cfg.normalize, cfg.max_seq_length, cfg.lowercase) == ("MEAN", False, 77, True)
    assert cfg.source == "sentence-transformers"


def test_sentence_transformers_v5_format_dense_normalize_prompt(tmp_path):
    from safetensors.torch import save_file

    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.base.modules.dense.Dense"}
    norm = {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"}
    folder = _st_folder(tmp_path, {"pooling_mode": "lasttoken"}, [dense, norm],
                        {"prompts": {"query": "query: ", "document": ""}, "default_prompt_name": "query"})
    _write(tmp_path, "2_Dense/config.json", {"in_features": 8, "out_features": 4, "bias": True,
                                             "activation_function": "torch.nn.modules.linear.Identity"})
    save_file({"linear.weight": torch.randn(4, 8), "linear.bias": torch.randn(4)},
              str(tmp_path / "2_Dense/model.safetensors"))
    cfg = load_pooler_config(folder, is_encoder=False, override='{"dimensions": 2}')
    assert (cfg.pooling_type, cfg.normalize, cfg.prompt, cfg.dimensions) == ("LAST", True, "query: ", 2)
    assert len(cfg.dense) == 1 and cfg.dense[0].activation == "identity"
    assert cfg.source == "sentence-transformers + --pooler-config"


@pytest.mark.parametrize("pooling,match", [
    ({"pooling_mode": "max"}, "pooling mode"),
    ({"pooling_mode_mean_sqrt_len_tokens": True}, "pooling mode"),
    ({"pooling_mode": "mean", "include_prompt": False}, "include_prompt"),
])
def test_sentence_transformers_unsupported_pooling_refused(tmp_path, pooling, match):
    with pytest.raises(ValueError, match=match):
        load_pooler_config(_st_folder(tmp_path, pooling), is_encoder=True)


def test_sentence_transformers_unknown_module_refused(tmp_path):
    odd = {"idx": 2, "name": "2", "path": "2_X", "type": "sentence_transformers.models.WeightedLayerPooling"}
    with pytest.raises(ValueError, match="WeightedLayerPooling"):
        load_pooler_config(_st_folder(tmp_path, {"pooling_mode": "cls"}, [odd]), is_encoder=True)


def test_architecture_defaults(tmp_path):
    assert (load_pooler_config(str(tmp_path), True).pooling_type, load_pooler_config(str(tmp_path), False).pooling_type) \
        == ("CLS", "LAST")


def test_poolers_arithmetic():
    h = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    assert pool(h, "CLS").tolist() == [1.0, 0.0] and pool(h, "LAST").tolist() == [3.0, 4.0]
    assert pool(h, "MEAN").tolist() == [2.0, 2.0]
    cfg = PoolerConfig("LAST", normalize=True)
    assert finish_embedding(torch.tensor([3.0, 4.0, 12.0]), cfg, PoolingParams(dimensions=2)).tolist() == \
        pytest.approx([0.6, 0.8])
    assert finish_embedding(torch.tensor([3.0, 4.0]), cfg, PoolingParams(normalize=False)).tolist() == [3.0, 4.0]
    assert classifier_output(torch.tensor([0.0]), cfg, PoolingParams()).tolist() == [0.5]
    assert classifier_output(torch.tensor([0.0, 0.0]), cfg, PoolingParams()).tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="dimensions=9"):
        check_dimensions(PoolingParams(dimensions=9), 8, None)
    with pytest.raises(ValueError, match="matryoshka"):
        check_dimensions(PoolingParams(dimensions=5), 8, [4, 8])
