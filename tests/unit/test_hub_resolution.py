"""Hub ids resolved offline against a Hugging Face cache laid out as huggingface_hub writes it
(tests/hub_cache.py); the files are placeholders: nothing here loads a model."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.arg_utils import MODEL_SOURCE_GROUP, add_engine_args, engine_config_from_args
from pagedllm.hub import choose_gguf, parse_model_id
from pagedllm.model_source import (
    pin_revisions,
    resolve_model,
    resolve_model_source,
    resolve_tokenizer,
    resolve_tokenizer_source,
)
from tests.hub_cache import add_revision, commit_hash

MAIN, V1 = commit_hash("main"), commit_hash("v1")
CHECKPOINT = {"config.json": b'{"v": 1}', "model.safetensors": b"weights-1", "tokenizer.json": b"{}",
              "tokenizer_config.json": b"{}", "generation_config.json": b"{}"}
GGUFS = ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-IQ4_XS.gguf", "Q8/m-Q8_0-00001-of-00002.gguf",
         "Q8/m-Q8_0-00002-of-00002.gguf", "mmproj-m-F16.gguf", "m-F16.gguf", "sub/m-Q6_K.gguf"]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """huggingface_hub's cache pointed at an empty folder, offline whatever the environment says."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.chdir(tmp_path)  # relative paths below are inside the test's folder
    add_revision(cache, "org/model", MAIN, CHECKPOINT)
    add_revision(cache, "org/model", V1, CHECKPOINT | {"model.safetensors": b"weights-2"}, refs=("v1",))
    add_revision(cache, "org/model-GGUF", MAIN, {name: name.encode() for name in GGUFS})
    add_revision(cache, "org/tok", MAIN, {"tokenizer.json": b"{}", "tokenizer_config.json": b"{}"})
    return cache


def test_parse_model_id():
    assert parse_model_id("org/name").repo_id == "org/name"
    parsed = parse_model_id("bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M")
    assert (parsed.repo_id, parsed.quant_tag) == ("bartowski/Llama-3.2-1B-Instruct-GGUF", "Q4_K_M")
    assert parse_model_id("org/name").quant_tag is None
    for not_an_id in ("./org/name", "/abs/model", "~/model", "a/b/c", "gpt2", "org/na me", "org/name:",
                      "org/name:Q4 K", "org/--x", "", "org/name.git"):
        assert parse_model_id(not_an_id) is None, not_an_id


def test_choose_gguf_by_tag():
    assert choose_gguf("r", GGUFS, "q4_k_m") == "m-Q4_K_M.gguf"  # case-insensitive
    assert choose_gguf("r", GGUFS, "F16") == "m-F16.gguf"  # the vision projector is not a model
    assert choose_gguf("r", GGUFS, "Q6_K") == "sub/m-Q6_K.gguf"
    assert choose_gguf("r", GGUFS, "XS") == "m-IQ4_XS.gguf"  # a part of the name, as a word
    assert choose_gguf("r", ["m-Q4_K_M.gguf"], "Q4_K") == "m-Q4_K_M.gguf"  # contained, the only one
    with pytest.raises(ValueError, match=r"'Q4_K' matches several GGUF files: m-Q4_K_M.gguf, m-Q4_K_S.gguf"):
        choose_gguf("r", GGUFS, "Q4_K")
    with pytest.raises(ValueError, match=r"no GGUF file matches the quantization tag 'Q5_K_M'\. "
                                         r"The repo's GGUF files: m-Q4_K_M.gguf, .*sub/m-Q6_K.gguf\."):
        choose_gguf("r", GGUFS, "Q5_K_M")
    with pytest.raises(ValueError, match=r"one part of a split GGUF \(2 parts: Q8/m-Q8_0-00001-of-00002.gguf, "
                                         r"Q8/m-Q8_0-00002-of-00002.gguf\).*llama-gguf-split --merge"):
        choose_gguf("r", GGUFS, "Q8_0")


def test_id_resolves_to_its_snapshot_and_revisions(hub):
    src = resolve_model("org/model")
    assert src.path == str(hub / "models--org--model" / "snapshots" / MAIN)
    assert (src.gguf_file, src.name, src.repo_id, src.revision) == (None, "org/model", "org/model", MAIN)
    for revision in ("v1", V1):  # a tag, a commit hash
        src = resolve_model("org/model", revision=revision)
        assert src.path.endswith(V1) and src.revision == V1
        assert open(f"{src.path}/model.safetensors", "rb").read() == b"weights-2"


def test_offline_miss_names_the_cache_and_revision(hub):
    folder = hub / "models--org--absent"
    with pytest.raises(ValueError) as e:
        resolve_model("org/absent")
    msg = str(e.value)
    assert "Model 'org/absent' (revision 'main') is not in the Hugging Face cache" in msg
    assert f"looked in {folder}; cache dir {hub}" in msg and "HF_HUB_OFFLINE=1" in msg
    with pytest.raises(ValueError, match=r"Model 'org/model' \(revision 'v2'\) is not in the Hugging Face cache"):
        resolve_model("org/model", revision="v2")
    missing_commit = commit_hash("never downloaded")
    with pytest.raises(ValueError, match=rf"revision '{missing_commit}'\) is not in the Hugging Face cache"):
        resolve_model("org/model", revision=missing_commit)
    with pytest.raises(ValueError, match="neither a Hugging Face model folder, a .gguf file, nor a Hub model id"):
        resolve_model("./org/absent")


def test_download_dir_replaces_the_default_cache(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=f"cache dir {tmp_path / 'empty'}"):
        resolve_model("org/model")
    assert resolve_model("org/model", download_dir=str(hub)).path.startswith(str(hub))
    config = EngineConfig(model="org/model", revision="v1", download_dir=str(hub))
    assert resolve_model_source(config).revision == V1


def test_local_path_wins_over_an_id(hub, tmp_path):
    local = tmp_path / "org" / "model"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    src = resolve_model("org/model")
    assert src.path == "org/model" and src.repo_id is None
    with pytest.raises(ValueError, match=r"revision='v1' applies to Hugging Face Hub ids; 'org/model' is a local path"):
        resolve_model("org/model", revision="v1")


def test_gguf_in_a_repo(hub):
    snapshot = hub / "models--org--model-GGUF" / "snapshots" / MAIN
    src = resolve_model("org/model-GGUF:Q4_K_M")
    assert (src.path, src.gguf_file, src.name) == (str(snapshot), "m-Q4_K_M.gguf", "org/model-GGUF:Q4_K_M")
    src = resolve_model("org/model-GGUF", gguf_file="m-Q4_K_S.gguf")
    assert (src.gguf_file, src.name) == ("m-Q4_K_S.gguf", "org/model-GGUF")
    src = resolve_model("org/model-GGUF:Q6_K")  # in a subfolder: the file's folder is the path
    assert (src.path, src.gguf_file) == (str(snapshot / "sub"), "m-Q6_K.gguf")
    with pytest.raises(ValueError, match=r"holds several GGUF files; name one with org/model-GGUF:TAG"):
        resolve_model("org/model-GGUF")
    with pytest.raises(ValueError, match=r"has no file 'm-Q2_K.gguf'. Its GGUF files: Q8/m-Q8_0-00001-of-00002.gguf, .*m-Q4_K_M.gguf"):
        resolve_model("org/model-GGUF", gguf_file="m-Q2_K.gguf")
    with pytest.raises(ValueError, match=r"Give either org/model-GGUF:Q4_K_M or gguf_file='m-F16.gguf'"):
        resolve_model("org/model-GGUF:Q4_K_M", gguf_file="m-F16.gguf")


def test_repo_without_loadable_weights(hub):
    add_revision(hub, "org/pickles", MAIN, {"config.json": b"{}", "pytorch_model.bin": b"x"})
    with pytest.raises(ValueError, match=r"org/pickles has no \*\.safetensors weights.*pytorch_model.bin"):
        resolve_model("org/pickles")
    add_revision(hub, "org/readme", MAIN, {"README.md": b"x"})
    with pytest.raises(ValueError, match=r"neither a config.json .* nor a .gguf file. Its files: README.md"):
        resolve_model("org/readme")


def test_tokenizer_ids(hub, tmp_path):
    tok = resolve_tokenizer("org/tok")  # tokenizer files only: no config.json needed
    assert tok.path.endswith(MAIN) and tok.repo_id == "org/tok"
    model = resolve_model("org/model", revision="v1")
    config = EngineConfig(model="org/model", revision="v1")
    assert resolve_tokenizer_source(config, model) is model
    # The model's own repo as tokenizer: the model's revision by default, tokenizer_revision if given.
    config = EngineConfig(model="org/model", revision="v1", tokenizer="org/model")
    assert resolve_tokenizer_source(config, model).revision == V1
    config = EngineConfig(model="org/model", revision="v1", tokenizer_revision="main")
    assert resolve_tokenizer_source(config, model).revision == MAIN
    # Another repo: its main branch, or tokenizer_revision.
    config = EngineConfig(model="org/model", revision="v1", tokenizer="org/tok")
    assert resolve_tokenizer_source(config, model).revision == MAIN
    config = EngineConfig(model="org/model", tokenizer="org/tok", tokenizer_revision="v9")
    with pytest.raises(ValueError, match=r"Model 'org/tok' \(revision 'v9'\) is not in the Hugging Face cache"):
        resolve_tokenizer_source(config, model)
    folder = tmp_path / "tokfolder"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    assert resolve_tokenizer(str(folder)).path == str(folder)
    with pytest.raises(ValueError, match="tokenizer_revision='v1' applies to Hugging Face Hub ids"):
        resolve_tokenizer(str(folder), revision="v1")
    local = EngineConfig(model=str(folder), tokenizer_revision="v1")
    with pytest.raises(ValueError, match=r"tokenizer_revision='v1' needs a Hub model id or tokenizer id"):
        resolve_tokenizer_source(local, resolve_tokenizer(str(folder)))


def test_pin_revisions_for_the_cores(hub):
    config = EngineConfig(model="org/model", tokenizer="org/tok")
    model = resolve_model_source(config)
    tok = resolve_tokenizer_source(config, model)
    pinned = pin_revisions(config, model, tok)
    assert (pinned.revision, pinned.tokenizer_revision) == (MAIN, MAIN)
    assert resolve_model_source(pinned) == model and resolve_tokenizer_source(pinned, model) == tok
    local = EngineConfig(model=None)
    assert pin_revisions(local, model.__class__("/x", None, "x"), model.__class__("/x", None, "x")) is local


def test_config_validation():
    with pytest.raises(ValueError, match=r"revision='v1' needs a model"):
        EngineConfig(revision="v1")
    with pytest.raises(ValueError, match=r"gguf_file='x.gguf' needs a model"):
        EngineConfig(gguf_file="x.gguf")
    with pytest.raises(ValueError, match="tokenizer_revision needs a Hub model id or tokenizer id"):
        EngineConfig(tokenizer_revision="v1")
    with pytest.raises(ValueError, match="gguf_file must name a .gguf file, got 'model.bin'"):
        EngineConfig(model="org/x", gguf_file="model.bin")
    with pytest.raises(ValueError, match="the model 'm.gguf' is already a .gguf file"):
        EngineConfig(model="m.gguf", gguf_file="x.gguf")
    with pytest.raises(ValueError, match="revision must be a branch, tag or commit hash without spaces"):
        EngineConfig(model="org/x", revision="my branch")
    with pytest.raises(ValueError, match="download_dir must be a non-empty string or None, got ''"):
        EngineConfig(download_dir="")


# A valid value other than the default for every flag of the model-source group.
MODEL_SOURCE_FLAGS = {
    "revision": (["--revision", "v1"], "v1"),
    "tokenizer_revision": (["--tokenizer-revision", "v2"], "v2"),
    "download_dir": (["--download-dir", "/models/hf"], "/models/hf"),
    "gguf_file": (["--gguf-file", "m-Q4_K_M.gguf"], "m-Q4_K_M.gguf"),
}


def test_every_model_source_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_positional=True)
    group = next(g for g in parser._action_groups if g.title == MODEL_SOURCE_GROUP)
    assert {a.dest for a in group._group_actions} == set(MODEL_SOURCE_FLAGS)
    for name, (argv, expected) in MODEL_SOURCE_FLAGS.items():
        config = engine_config_from_args(parser.parse_args(["org/model", *argv]))
        assert getattr(config, name) == expected and getattr(EngineConfig(), name) != expected, name
        assert config.model == "org/model"
    assert engine_config_from_args(parser.parse_args(["--model", "org/m"])).model == "org/m"
    with pytest.raises(ValueError, match=r"Two models given: 'org/a' \(positional\) and --model 'org/b'"):
        engine_config_from_args(parser.parse_args(["org/a", "--model", "org/b"]))


def test_serve_command_line_resolves_the_id(hub):
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "org/model", "--revision", "v1", "--download-dir", str(hub)])
    config = engine_config_from_args(args)
    src = resolve_model_source(config)
    assert (src.name, src.revision) == ("org/model", V1)


def test_cached_snapshot_missing_a_shard(hub):
    """The shard index names a file the cached snapshot lacks: named, not a later load error."""
    index = b'{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    add_revision(hub, "org/sharded", MAIN, {"config.json": b"{}", "model.safetensors.index.json": index,
                                            "model-00001-of-00002.safetensors": b"1"})
    snapshot = hub / "models--org--sharded" / "snapshots" / MAIN
    with pytest.raises(ValueError, match=rf"Model 'org/sharded' \(revision 'main'\) is only partly in the "
                                         rf"Hugging Face cache at {snapshot}: it lacks "
                                         r"model-00002-of-00002.safetensors, and offline mode"):
        resolve_model("org/sharded")
    add_revision(hub, "org/sharded", MAIN, {"model-00002-of-00002.safetensors": b"2"})
    assert resolve_model("org/sharded").path == str(snapshot)


def test_a_vision_language_repo_downloads_its_processor_files():
    """AutoProcessor reads preprocessor_config.json / processor_config.json: a multimodal model's
    download takes them with the config and tokenizer (they were not fetched before issue 45)."""
    from huggingface_hub.utils import filter_repo_objects

    from pagedllm.hub import _choose_files

    files = ["config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json",
             "processor_config.json", "chat_template.json", "README.md"]
    gguf, patterns = _choose_files("llava-hf/llava-1.5-7b-hf", files, None, None, weights=True)
    assert gguf is None
    got = set(filter_repo_objects(files, allow_patterns=patterns))
    assert {"preprocessor_config.json", "processor_config.json", "chat_template.json"} <= got
    assert "README.md" not in got
