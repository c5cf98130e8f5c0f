"""LoRA adapters (pagedllm/lora): made by peft itself on tiny transformers models, loaded by
pagedllm's loader (which does not import peft), compared with peft's own layer outputs; every
refusal and validation error names its field, file or tensor; the tensor-parallel cut against
the unsplit product and the base layers' own split; `LoRARequest`'s rules and wire form."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.lora.adapter import shard_adapter
from pagedllm.lora.model_spec import lora_model_spec, tp_range
from pagedllm.lora.peft_adapter import load_peft_adapter
from pagedllm.lora.request import LoRARequest
from tests.hub_cache import add_revision, commit_hash

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PREFIX = "base_model.model.model.layers"


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False)


def phi3_config():
    from transformers import Phi3Config

    return Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def make_adapter(folder: Path, config, safe: bool = True, **lora_kwargs):
    """A peft LoRA (B != 0) on a fresh random model of `config`, saved to `folder`; the peft model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    kwargs = dict(r=8, lora_alpha=16, init_lora_weights=False) | lora_kwargs
    model = get_peft_model(base, peft.LoraConfig(**kwargs)).eval()
    model.save_pretrained(folder, safe_serialization=safe)
    return model


def request(folder: Path, lora_id: int = 1) -> LoRARequest:
    return LoRARequest(f"adapter{lora_id}", lora_id, str(folder))


def peft_lora_layers(model) -> dict[tuple[int, str], torch.nn.Module]:
    """(layer, module name) -> peft's LoRA layer (base + delta in its forward)."""
    from peft.tuners.lora import LoraLayer

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            parts = name.split(".")
            found[int(parts[parts.index("layers") + 1]), parts[-1]] = module
    return found


@torch.no_grad()
def assert_matches_peft(model, adapter, spec) -> None:
    """x @ (W + B A)^T from our A / B equals peft's layer output, for every adapted module."""
    layers = peft_lora_layers(model)
    assert layers
    covered = set()
    for (layer, module), lora in layers.items():
        parts = spec.checkpoint_modules[module]
        delta = torch.cat([adapter.get(layer, p).delta() for p in parts])
        covered.update((layer, p) for p in parts)
        weight = lora.base_layer.weight
        x = torch.randn(5, weight.shape[1])
        torch.testing.assert_close(x @ (weight + delta).T, lora(x), rtol=0, atol=1e-5)
    assert covered == set(adapter.weights)


@pytest.fixture(scope="module")
def llama_adapter(tmp_path_factory):
    """An adapter on q/k/v/o/gate/up/down; tests copy its folder and spoil the copy."""
    folder = tmp_path_factory.mktemp("llama_lora")
    model = make_adapter(folder, llama_config(), target_modules=ALL)
    return folder, model


@pytest.fixture
def adapter_copy(llama_adapter, tmp_path):
    folder = tmp_path / "adapter"
    shutil.copytree(llama_adapter[0], folder)
    return folder


def edit_config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def edit_tensors(folder: Path, edit) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


# ---- peft's arithmetic ---------------------------------------------------------------------

def test_all_projections_match_peft(llama_adapter):
    folder, model = llama_adapter
    spec = lora_model_spec(llama_config())
    adapter = load_peft_adapter(request(folder, 7), spec)
    assert (adapter.name, adapter.lora_int_id, adapter.rank, adapter.scaling) == ("adapter7", 7, 8, 2.0)
    assert len(adapter.weights) == 2 * 7
    w = adapter.get(1, "k_proj")
    assert w.lora_a.dtype == w.lora_b.dtype == torch.float32
    assert (w.lora_a.shape, w.lora_b.shape, w.scaling) == ((8, 64), (32, 8), 2.0)
    assert_matches_peft(model, adapter, spec)


@pytest.mark.parametrize("lora_kwargs", [
    dict(target_modules=["q_proj", "v_proj"], use_rslora=True, r=4, lora_alpha=6),
    dict(target_modules=r".*\.(q_proj|down_proj)"),  # a regex, matched on the whole module name
    dict(target_modules=r"model\.layers\.1\.mlp\..*_proj"),  # one layer only, by regex
    dict(target_modules=["q_proj", "v_proj", "up_proj"], rank_pattern={"v_proj": 4},
         alpha_pattern={r"layers\.1\.self_attn\.q_proj": 40}),
    dict(target_modules=["q_proj", "o_proj"], exclude_modules=r".*layers\.0\.self_attn\.o_proj"),
    dict(target_modules="all-linear"),
], ids=["rslora", "regex", "regex-one-layer", "rank-alpha-patterns", "exclude", "all-linear"])
def test_config_variants_match_peft(tmp_path, lora_kwargs):
    model = make_adapter(tmp_path, llama_config(), **lora_kwargs)
    spec = lora_model_spec(llama_config())
    adapter = load_peft_adapter(request(tmp_path), spec)
    assert_matches_peft(model, adapter, spec)
    if "use_rslora" in lora_kwargs:
        assert adapter.scaling == pytest.approx(6 / math.sqrt(4))
    if "rank_pattern" in lora_kwargs:
        assert (adapter.get(0, "v_proj").rank, adapter.get(0, "q_proj").rank, adapter.rank) == (4, 8, 8)
        assert (adapter.get(1, "q_proj").scaling, adapter.get(0, "q_proj").scaling) == (5.0, 2.0)


def test_phi3_fused_modules_split_into_parts(tmp_path):
    config = phi3_config()
    model = make_adapter(tmp_path, config, target_modules=["qkv_proj", "gate_up_proj", "o_proj", "down_proj"])
    spec = lora_model_spec(config)
    adapter = load_peft_adapter(request(tmp_path), spec)
    assert sorted({m for _, m in adapter.weights}) == sorted(ALL)
    assert (adapter.get(0, "q_proj").lora_b.shape, adapter.get(0, "v_proj").lora_b.shape) == ((64, 8), (32, 8))
    assert adapter.get(0, "k_proj").lora_a is adapter.get(0, "q_proj").lora_a  # one A for the fused rows
    assert_matches_peft(model, adapter, spec)


def test_bin_weights_load_like_safetensors(tmp_path):
    model = make_adapter(tmp_path, llama_config(), safe=False, target_modules=["q_proj", "down_proj"])
    assert (tmp_path / "adapter_model.bin").is_file() and not (tmp_path / "adapter_model.safetensors").exists()
    spec = lora_model_spec(llama_config())
    assert_matches_peft(model, load_peft_adapter(request(tmp_path), spec), spec)


def test_merged_weights_equal_merge_and_unload(tmp_path):
    model = make_adapter(tmp_path, llama_config(), target_modules=["o_proj", "gate_proj"])
    adapter = load_peft_adapter(request(tmp_path), lora_model_spec(llama_config()))
    base = {n: p.detach().clone() for n, p in model.get_base_model().named_parameters() if "lora_" not in n}
    merged = dict(model.merge_and_unload().named_parameters())
    for (layer, module), w in adapter.weights.items():
        block = "self_attn" if module == "o_proj" else "mlp"
        name = f"model.layers.{layer}.{block}.{module}.weight"
        before = base[f"model.layers.{layer}.{block}.{module}.base_layer.weight"]
        torch.testing.assert_close(merged[name].detach(), before + w.delta(), rtol=0, atol=1e-5)


# ---- model specs -----------------------------------------------------------------------------

def test_spec_sizes_and_families():
    from transformers import MixtralConfig, Qwen3Config

    spec = lora_model_spec(llama_config())
    assert (spec.num_layers, spec.head_dim) == (2, 16)
    assert [(m.in_features, m.out_features, m.fused_module, m.slice_index) for m in spec.modules.values()] == [
        (64, 64, "qkv_proj", 0), (64, 32, "qkv_proj", 1), (64, 32, "qkv_proj", 2), (64, 64, "o_proj", None),
        (64, 128, "gate_up_proj", 0), (64, 128, "gate_up_proj", 1), (128, 64, "down_proj", None)]
    qwen3 = lora_model_spec(Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32))
    q, o = qwen3.modules["q_proj"], qwen3.modules["o_proj"]
    assert (qwen3.num_layers, q.out_features, o.in_features) == (3, 128, 128)
    assert lora_model_spec(phi3_config()).checkpoint_modules["qkv_proj"] == ("q_proj", "k_proj", "v_proj")
    mixtral = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    with pytest.raises(ValueError, match=r"mixture-of-experts models \(MixtralForCausalLM\) are not supported"):
        lora_model_spec(mixtral)


# ---- tensor parallelism ------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])  # 4 ranks > 2 KV heads: each KV head replicated on 2 ranks
def test_sharded_adapter_matches_unsplit_product_and_base_split(llama_adapter, world):
    from pagedllm.model.llama import LlamaAttention, LlamaMLP

    config = llama_config()
    spec = lora_model_spec(config)
    adapter = load_peft_adapter(request(llama_adapter[0]), spec)
    x_hidden, x_inter = torch.randn(3, 64), torch.randn(3, 128)
    ranks = [shard_adapter(adapter, spec, rank, world) for rank in range(world)]
    for (layer, module), full in adapter.weights.items():
        m = spec.modules[module]
        x = x_hidden if m.in_features == 64 else x_inter
        y_full = x @ full.delta().T
        if m.parallel == "column":  # each rank's output rows: its part of the full output
            for rank, part in enumerate(ranks):
                start, length = tp_range(spec, module, rank, world)
                assert part.get(layer, module).lora_a is full.lora_a
                torch.testing.assert_close(x @ part.get(layer, module).delta().T, y_full[:, start:start + length])
        else:  # each rank's input columns; the all-reduce sums the partial products
            total = torch.zeros_like(y_full)
            for rank, part in enumerate(ranks):
                start, length = tp_range(spec, module, rank, world)
                assert part.get(layer, module).lora_b is full.lora_b
                total += x[:, start:start + length] @ part.get(layer, module).delta().T
            torch.testing.assert_close(total, y_full)
    for rank in range(world):  # the same cut as the base layers'
        tp = TensorParallelGroup(rank, world, "gloo")
        attn = LlamaAttention(config, 0, torch.float32, "cpu", tp=tp)
        mlp = LlamaMLP(config, torch.float32, "cpu", tp=tp)
        assert [tp_range(spec, m, rank, world) for m in ("q_proj", "k_proj", "v_proj")] == \
            list(attn.qkv_proj.tp_shard.out_ranges)
        assert [tp_range(spec, m, rank, world) for m in ("gate_proj", "up_proj")] == \
            list(mlp.gate_up_proj.tp_shard.out_ranges)
        assert tp_range(spec, "o_proj", rank, world) == attn.o_proj.tp_shard.in_range
        assert tp_range(spec, "down_proj", rank, world) == mlp.down_proj.tp_shard.in_range
    assert shard_adapter(adapter, spec, 0, 1) is adapter
    with pytest.raises(ValueError, match="does not divide into 3 tensor-parallel ranks"):
        shard_adapter(adapter, spec, 0, 3)


# ---- refusals: what is not built, by name --------------------------------------------------------

@pytest.mark.parametrize("field,value,message", [
    ("use_dora", True, "use_dora=True: DoRA adapters"),
    ("modules_to_save", ["lm_head"], "modules_to_save=['lm_head']"),
    ("bias", "all", "bias='all': adapter biases are not supported"),
    ("fan_in_fan_out", True, "fan_in_fan_out=True"),
    ("layers_to_transform", [0], "layers_to_transform=[0]"),
    ("layers_pattern", "layers", "layers_pattern='layers'"),
    ("lora_bias", True, "lora_bias=True"),
    ("layer_replication", [[0, 2]], "layer_replication"),
    ("target_parameters", ["mlp.experts.gate_up_proj"], "target_parameters"),
    ("trainable_token_indices", [3, 4], "trainable_token_indices"),
    ("use_qalora", True, "use_qalora=True"),
    ("alora_invocation_tokens", [5], "alora_invocation_tokens"),
    ("peft_type", "LOHA", "peft_type='LOHA' is not supported: only LoRA"),
    ("kasa_config", {"k": 1}, "kasa_config={'k': 1} is not supported (a PEFT option pagedllm does not know"),
    ("r", 0, "r must be a positive integer, got 0"),
    ("lora_alpha", "16", "lora_alpha must be a finite number"),
    ("rank_pattern", {"q_proj": 0}, "rank_pattern['q_proj'] must be a positive integer"),
    ("target_modules", ["q_proj", "embed_tokens"], "selects embed_tokens: LoRA on the embeddings"),
    ("target_modules", ["q_proj", "lm_head"], "selects lm_head"),
    ("target_modules", r".*(q_proj|lm_head)", "selects lm_head"),
    ("target_modules", ["q_proj", "c_attn"], "target module 'c_attn' is not a module of LlamaForCausalLM"),
    ("target_modules", r".*\.c_attn", r"selects no module of LlamaForCausalLM"),
    ("target_modules", "q_proj[", "is not a valid regular expression"),
    ("target_modules", None, "target_modules must be a list of module names or a regex string"),
])
def test_config_refusals_name_the_field(adapter_copy, field, value, message):
    edit_config(adapter_copy, **{field: value})
    with pytest.raises(ValueError) as e:
        load_peft_adapter(request(adapter_copy), lora_model_spec(llama_config()))
    assert "adapter_config.json" in str(e.value)
    assert message in str(e.value)


def test_target_modules_narrower_than_the_weights(adapter_copy):
    edit_config(adapter_copy, target_modules=["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    with pytest.raises(ValueError, match=rf"adapter_model.safetensors: tensor {PREFIX}.0.self_attn.v_proj.lora_A"
                                         r".weight: module model.layers.0.self_attn.v_proj is not selected by the"):
        load_peft_adapter(request(adapter_copy), lora_model_spec(llama_config()))


def test_added_tokens_refused(adapter_copy):
    save_file({"input_embeddings": torch.zeros(2, 64)}, adapter_copy / "new_embeddings.safetensors")
    with pytest.raises(ValueError, match="new_embeddings.safetensors: added tokens"):
        load_peft_adapter(request(adapter_copy), lora_model_spec(llama_config()))


# ---- validation: files, ranks, tensors -------------------------------------------------------------

def test_missing_folder_file_config_and_weights(tmp_path, adapter_copy):
    spec = lora_model_spec(llama_config())
    with pytest.raises(ValueError, match=r"LoRA adapter 'adapter1': folder .*nowhere does not exist"):
        load_peft_adapter(request(tmp_path / "nowhere"), spec)
    with pytest.raises(ValueError, match=r"adapter_config.json is a file; give the adapter's folder"):
        load_peft_adapter(request(adapter_copy / "adapter_config.json"), spec)
    (adapter_copy / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"'adapter1': cannot read .*adapter_config.json"):
        load_peft_adapter(request(adapter_copy), spec)
    (adapter_copy / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match=r"'adapter1': no adapter_config.json in .*adapter"):
        load_peft_adapter(request(adapter_copy), spec)
    empty = tmp_path / "config_only"
    empty.mkdir()
    (empty / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj"]}))
    with pytest.raises(ValueError, match=r"no adapter_model.safetensors or adapter_model.bin in .*config_only"):
        load_peft_adapter(request(empty), spec)


def test_rank_above_max_lora_rank(adapter_copy):
    spec = lora_model_spec(llama_config())
    with pytest.raises(ValueError, match=r"rank 8 of model.layers.0.self_attn.q_proj is greater than max_lora_rank=4"):
        load_peft_adapter(request(adapter_copy), spec, max_lora_rank=4)
    assert load_peft_adapter(request(adapter_copy), spec, max_lora_rank=8).rank == 8
    edit_config(adapter_copy, rank_pattern={"down_proj": 32})
    with pytest.raises(ValueError, match=r"rank 32 of model.layers.0.mlp.down_proj is greater than max_lora_rank=16"):
        load_peft_adapter(request(adapter_copy), spec)


def _put(name, tensor):
    return lambda t: t.__setitem__(name, tensor)


def _drop(name):
    return lambda t: t.pop(name)


def _nan(name):
    def edit(t):
        t[name] = t[name].clone()
        t[name][0, 0] = float("nan")
    return edit


@pytest.mark.parametrize("edit,message", [
    (_put(f"{PREFIX}.2.self_attn.q_proj.lora_A.weight", torch.zeros(8, 64)),
     rf"tensor {PREFIX}.2.self_attn.q_proj.lora_A.weight: layer index 2 is past the model's 2 layers"),
    (_put(f"{PREFIX}.0.self_attn.c_attn.lora_A.weight", torch.zeros(8, 64)),
     r"c_attn.lora_A.weight: self_attn.c_attn is not a LoRA module of LlamaForCausalLM"),
    (_put(f"{PREFIX}.0.mlp.q_proj.lora_A.weight", torch.zeros(8, 64)), r"mlp.q_proj is not a LoRA module"),
    (_put("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(8, 256)),
     r"tensor base_model.model.model.embed_tokens.lora_embedding_A: LoRA on the embeddings is not supported"),
    (_put("base_model.model.lm_head.lora_A.weight", torch.zeros(8, 64)),
     r"tensor base_model.model.lm_head.lora_A.weight: LoRA on the LM head"),
    (_put(f"{PREFIX}.0.self_attn.q_proj.lora_magnitude_vector", torch.zeros(64)), "DoRA magnitudes"),
    (_put(f"{PREFIX}.0.self_attn.q_proj.lora_B.bias", torch.zeros(64)), "a bias on lora_B"),
    (_put("something.else", torch.zeros(1)), "tensor something.else: not the lora_A / lora_B weight"),
    (_drop(f"{PREFIX}.1.self_attn.v_proj.lora_B.weight"),
     rf"missing tensor {PREFIX}.1.self_attn.v_proj.lora_B.weight \(the config targets that module\)"),
    (_put(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", torch.zeros(8, 32)),
     rf"tensor {PREFIX}.0.self_attn.q_proj.lora_A.weight has shape \(8, 32\), expected \(8, 64\) "
     r"\(\[r, in_features\] of LlamaForCausalLM's q_proj with r=8\)"),
    (_put(f"{PREFIX}.1.self_attn.v_proj.lora_B.weight", torch.zeros(64, 8)),
     rf"v_proj.lora_B.weight has shape \(64, 8\), expected \(32, 8\) \(\[out_features, r\]"),
    (_put(f"{PREFIX}.0.mlp.down_proj.lora_A.weight", torch.zeros(4, 128)),
     r"down_proj.lora_A.weight has shape \(4, 128\), expected \(8, 128\)"),
    (_put(f"{PREFIX}.0.mlp.up_proj.lora_A.weight", torch.zeros(8, 64, dtype=torch.int32)),
     r"up_proj.lora_A.weight has dtype torch.int32, expected a floating-point type"),
    (_nan(f"{PREFIX}.1.mlp.gate_proj.lora_B.weight"),
     rf"tensor {PREFIX}.1.mlp.gate_proj.lora_B.weight has non-finite values"),
], ids=["layer-past", "unknown-module", "wrong-block", "embedding", "lm-head", "dora", "lora-bias", "stray",
        "missing-B", "A-shape", "B-shape", "rank-mismatch", "int-dtype", "nan"])
def test_tensor_errors_name_the_tensor(adapter_copy, edit, message):
    edit_tensors(adapter_copy, edit)
    with pytest.raises(ValueError, match=message) as e:
        load_peft_adapter(request(adapter_copy), lora_model_spec(llama_config()))
    assert "adapter_model.safetensors" in str(e.value)


def test_config_rank_disagreeing_with_the_tensors(adapter_copy):
    edit_config(adapter_copy, r=4)
    with pytest.raises(ValueError, match=r"q_proj.lora_A.weight has shape \(8, 64\), expected \(4, 64\)"):
        load_peft_adapter(request(adapter_copy), lora_model_spec(llama_config()))


def test_base_model_mismatch_warns_unless_strict(adapter_copy, caplog):
    spec = lora_model_spec(llama_config())
    edit_config(adapter_copy, base_model_name_or_path="org/Tiny-Llama")
    with caplog.at_level(logging.WARNING, logger="pagedllm.lora.peft_adapter"):
        load_peft_adapter(request(adapter_copy), spec, base_model="/models/tiny-llama/")  # same last component
        assert not caplog.records
        load_peft_adapter(request(adapter_copy), spec, base_model="org/other")
    assert "base_model_name_or_path='org/Tiny-Llama' is not the served model 'org/other'" in caplog.text
    with pytest.raises(ValueError, match=r"adapter_config.json: base_model_name_or_path='org/Tiny-Llama' is not"):
        load_peft_adapter(request(adapter_copy), spec, base_model="org/other", strict_base_model=True)


def test_hub_id_only_from_the_local_cache(llama_adapter, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    spec = lora_model_spec(llama_config())
    with pytest.raises(ValueError, match=r"'org/absent' is neither a local folder nor in the local Hugging Face cache"):
        load_peft_adapter(LoRARequest("a", 1, "org/absent"), spec)
    files = {name: llama_adapter[0] / name for name in ("adapter_config.json", "adapter_model.safetensors")}
    add_revision(cache, "org/lora", commit_hash("main"), files)
    adapter = load_peft_adapter(LoRARequest("a", 1, "org/lora"), spec)
    assert len(adapter.weights) == 14


# ---- LoRARequest -------------------------------------------------------------------------------

def test_lora_request_rules_and_identity():
    a = LoRARequest("sql", 3, "/adapters/sql", base_model_name="base")
    assert (a.adapter_id, a.name, a.path) == (3, "sql", "/adapters/sql")
    b = LoRARequest("sql-renamed", 3, "/elsewhere")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1  # identity is lora_int_id
    assert a != LoRARequest("sql", 4, "/adapters/sql")
    for bad_id in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=rf"lora_int_id must be an integer > 0, got {bad_id!r}"):
            LoRARequest("x", bad_id, "/p")
    with pytest.raises(ValueError, match="lora_path cannot be empty"):
        LoRARequest("x", 1)
    with pytest.raises(ValueError, match="lora_name must be a non-empty string"):
        LoRARequest("", 1, "/p")
    with pytest.raises(ValueError, match=r"long_lora_max_len=4096 .*LongLoRA adapters .* are not supported"):
        LoRARequest("x", 1, "/p", long_lora_max_len=4096)
    with pytest.raises(ValueError, match="tensorizer_config_dict is set .*tensorizer-serialized adapters"):
        LoRARequest("x", 1, "/p", tensorizer_config_dict={"uri": "s3://x"})


def test_lora_request_wire_form():
    a = LoRARequest("sql", 3, "/adapters/sql", base_model_name="base")
    wire = msgspec.msgpack.encode(a)
    back = msgspec.msgpack.decode(wire, type=LoRARequest)
    assert back == a
    assert (back.lora_name, back.lora_path, back.base_model_name) == ("sql", "/adapters/sql", "base")
    with pytest.raises(ValueError, match="lora_int_id must be an integer > 0, got 0"):  # checked on decode too
        msgspec.msgpack.decode(msgspec.msgpack.encode(["sql", 0, "/p"]), type=LoRARequest)
    with pytest.raises(ValueError, match="long_lora_max_len"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(["sql", 1, "/p", 10]), type=LoRARequest)


@pytest.mark.slow  # seconds (a subprocess / a compile): not in the quick `not slow` run
def test_request_imports_no_torch_and_loader_no_peft(llama_adapter):
    """The front end imports `LoRARequest` without torch; serving loads adapters without peft."""
    import subprocess
    import sys

    code = ("import sys; from pagedllm.lora.request import LoRARequest; assert 'torch' not in sys.modules, 'torch'\n"
            "from pagedllm.lora.peft_adapter import load_peft_adapter\n"
            "from pagedllm.lora.model_spec import lora_model_spec\n"
            "from transformers import LlamaConfig\n"
            "c = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, "
            "num_attention_heads=4, num_key_value_heads=2)\n"
            f"a = load_peft_adapter(LoRARequest('a', 1, {str(llama_adapter[0])!r}), lora_model_spec(c))\n"
            "assert len(a.weights) == 14, len(a.weights)\n"
            "assert 'peft' not in sys.modules, sorted(m for m in sys.modules if 'peft' in m)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
