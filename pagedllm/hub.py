"""Model ids on the Hugging Face Hub (`org/name`, `org/name:Q4_K_M`) resolved to a local folder.

Everything goes through huggingface_hub (`HfApi.resolve_revision`, `model_info`,
`get_cached_repo_tree`, `snapshot_download`, `hf_hub_download`), so its cache layout and its
environment apply unchanged: `HF_HOME` / `HF_HUB_CACHE` (where the cache is), `HF_HUB_OFFLINE`
(no network: the cache or an error), `HF_TOKEN` (private and gated repos), `HF_ENDPOINT`
(a mirror). pagedllm adds only the choice of files (config, tokenizer, chat template,
safetensors shards, or one GGUF file) and errors that say what to do (docs/model_ids.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Files a checkpoint folder needs besides its weights: the model's config and generation
# defaults, every tokenizer format transformers reads, and the chat template files.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "*.tiktoken",
    "chat_template.jinja", "chat_template.json",
)
CONFIG_FILES = ("config.json", "generation_config.json")
# sentence-transformers' pooling configuration (pagedllm/pooling/pooler_config.py): small files,
# fetched with the config so that an embedding model pools as its authors set it up
POOLING_FILES = ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json",
                 "*_Pooling/config.json", "*_Dense/config.json", "*_Dense/model.safetensors",
                 "*_Dense/pytorch_model.bin", "*_Normalize/*")
# A multimodal model's processor (docs/multimodal.md): image processor, processor, video
# processor settings (small JSON files AutoProcessor reads)
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
SAFETENSORS_INDEX = "model.safetensors.index.json"
# `name-00001-of-00003.gguf`: llama.cpp's split GGUF parts (one model in several files).
_SPLIT_GGUF = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class HubModelId:
    """A parsed model id: the repo, and the GGUF quantization tag of `org/name:TAG` if any."""

    repo_id: str
    quant_tag: str | None = None


@dataclass(frozen=True)
class HubSnapshot:
    """A resolved id: the snapshot folder (for a GGUF, the folder holding the file) at `commit`."""

    repo_id: str
    revision: str  # as asked ("main", a tag, a commit hash)
    commit: str
    path: str
    gguf_file: str | None


def parse_model_id(model: str) -> HubModelId | None:
    """`org/name` or `org/name:TAG` as a HubModelId; None when `model` cannot be a Hub id (a
    path such as `./x`, `/x`, `~/x`, `a/b/c`), so that the caller reports a missing path."""
    # lazy: huggingface_hub (0.2 s) stays out of the CLI's start-up
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not model or model[0] in "./~" or model.count("/") != 1:
        return None
    repo_id, sep, tag = model.partition(":")
    if sep and not re.fullmatch(r"[A-Za-z0-9][\w.-]*", tag):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return HubModelId(repo_id, tag or None)


def hub_cache_dir(download_dir: str | os.PathLike | None) -> str:
    """The cache folder snapshot_download uses: `download_dir`, else huggingface_hub's own
    (`HF_HUB_CACHE`, default `$HF_HOME/hub`), read from its constants at call time."""
    # lazy: huggingface_hub (0.2 s) stays out of the CLI's start-up
    from huggingface_hub import constants

    return str(Path(download_dir if download_dir is not None else constants.HF_HUB_CACHE).expanduser().resolve())


def _repo_cache_folder(repo_id: str, cache: str) -> str:
    # lazy: huggingface_hub (0.2 s) stays out of the CLI's start-up
    from huggingface_hub.file_download import repo_folder_name

    return os.path.join(cache, repo_folder_name(repo_id=repo_id, repo_type="model"))


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str, cache: str) -> Iterator[None]:
    """huggingface_hub's errors as ValueErrors saying what happened and what to do."""
    # lazy: huggingface_hub (0.2 s) stays out of the CLI's start-up
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
        RevisionResolutionError,
    )

    where = _repo_cache_folder(repo_id, cache)
    what = f"Model {repo_id!r} (revision {revision!r})"
    try:
        yield
    except GatedRepoError as e:
        raise ValueError(
            f"{what} is a gated repository on the Hugging Face Hub: accept its terms at "
            f"{constants.ENDPOINT}/{repo_id} and set HF_TOKEN to a token of an account that has "
            "access (or run `hf auth login`)."
        ) from e
    except RepositoryNotFoundError as e:
        raise ValueError(
            f"{what}: no such repository on the Hugging Face Hub ({constants.ENDPOINT}), nor a local "
            "folder or file of that name. If it is private, set HF_TOKEN to a token that can read it."
        ) from e
    except RevisionNotFoundError as e:
        raise ValueError(
            f"{what}: the repository has no revision {revision!r} (a branch, tag or commit hash)."
        ) from e
    except IncompleteSnapshotError as e:
        raise ValueError(
            f"{what} is only partly in the Hugging Face cache at {where} and cannot be completed "
            f"now: {e}"
        ) from e
    except (RevisionResolutionError, LocalEntryNotFoundError) as e:
        if constants.is_offline_mode():
            reason = "offline mode (HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1) forbids downloading it"
        else:
            reason = f"the Hub ({constants.ENDPOINT}) could not be reached: {e}"
        raise ValueError(
            f"{what} is not in the Hugging Face cache (looked in {where}; cache dir {cache}) and "
            f"{reason}. No local folder or file of that name exists either. Download it where the "
            f"Hub is reachable (`hf download {repo_id}`), or point HF_HOME / HF_HUB_CACHE / "
            "download_dir at a cache that holds it."
        ) from e
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        hint = " Check HF_TOKEN." if status in (401, 403) else ""
        raise ValueError(f"{what}: the Hugging Face Hub answered HTTP {status}: {e}.{hint}") from e


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The connection errors huggingface_hub lets through from its HTTP client."""
    # lazy: huggingface_hub (0.2 s) stays out of the CLI's start-up
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:  # lazy, and which one exists depends on huggingface_hub's version
        import httpx2

        return (OfflineModeIsEnabled, httpx2.TransportError)
    except ImportError:  # older huggingface_hub (httpx)
        import httpx

        return (OfflineModeIsEnabled, httpx.TransportError)


def _snapshot_files(folder: str) -> list[str]:
    """Files present in a cached snapshot folder, as repo paths (`sub/x.gguf`)."""
    out = []
    for root, _dirs, names in os.walk(folder):
        for n in names:
            full = os.path.join(root, n)
            if os.path.isfile(full):  # a symlink to a blob that is there
                out.append(os.path.relpath(full, folder).replace(os.sep, "/"))
    return sorted(out)


def _repo_files(api, repo_id: str, revision, cache: str) -> tuple[list[str], bool]:
    """(the repo's files at the resolved commit, whether to ask the Hub for missing ones): the
    cached tree listing (a commit never changes), else the Hub's (`model_info`: one request
    that fails fast, where a tree listing retries for 23 s), else, offline or with the Hub
    unreachable or down, what the cached snapshot holds."""
    # lazy: huggingface_hub (0.2 s) stays out of the CLI's start-up
    from huggingface_hub import get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, HfHubHTTPError

    try:
        return sorted(f.path for f in get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache)), True
    except CachedRepoTreeNotFoundError:
        pass
    try:
        info = api.model_info(repo_id, revision=revision.resolved)
        return sorted(s.rfilename for s in info.siblings or []), True
    except HfHubHTTPError as e:
        if e.response is None or e.response.status_code < 500:
            raise
    except _transport_errors():
        pass
    folder = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    return _snapshot_files(folder), False


def _gguf_base(name: str) -> str:
    """A GGUF's name without its split suffix: the parts of one split model share it."""
    return _SPLIT_GGUF.sub(".gguf", name)


def _model_ggufs(files: list[str]) -> list[str]:
    """The repo's GGUF model files (vision projectors `mmproj*` are not language models)."""
    return [f for f in files if f.lower().endswith(".gguf")
            and not os.path.basename(f).lower().startswith("mmproj")]


def _refuse_split(repo_id: str, name: str, files: list[str]) -> None:
    if _SPLIT_GGUF.search(name):
        parts = [f for f in files if _gguf_base(f) == _gguf_base(name)]
        raise ValueError(
            f"{repo_id}: {name} is one part of a split GGUF ({len(parts)} parts: {', '.join(parts)}); "
            "pagedllm loads single-file GGUFs only. Merge the parts first "
            f"(`llama-gguf-split --merge {parts[0] if parts else name} merged.gguf`) and pass that file."
        )


def choose_gguf(repo_id: str, files: list[str], quant_tag: str) -> str:
    """The repo's one GGUF whose name holds `quant_tag` (case-insensitive), as llama.cpp's
    `-hf org/name:TAG` and Ollama pick it: a match as a whole word of the name (not inside
    `Q4_K_M` for `Q4_K`) wins; otherwise any file containing the tag. Split parts count as
    one model (and are refused by name). None or several: a ValueError listing the GGUFs."""
    ggufs = _model_ggufs(files)
    tag = re.escape(quant_tag)
    for pattern in (rf"(?<![A-Za-z0-9_]){tag}(?![A-Za-z0-9_])", tag):
        hits = [f for f in ggufs if re.search(pattern, os.path.basename(f), re.IGNORECASE)]
        models = sorted({_gguf_base(f) for f in hits})
        if len(models) == 1:
            first = sorted(hits)[0]
            _refuse_split(repo_id, first, files)
            return first
        if len(models) > 1:
            raise ValueError(
                f"{repo_id}: quantization tag {quant_tag!r} matches several GGUF files: "
                f"{', '.join(sorted(hits))}. Use a longer tag or gguf_file= / --gguf-file NAME."
            )
    listing = ", ".join(ggufs) if ggufs else "none"
    raise ValueError(f"{repo_id}: no GGUF file matches the quantization tag {quant_tag!r}. "
                     f"The repo's GGUF files: {listing}.")


def _choose_files(repo_id: str, files: list[str], gguf_file: str | None, quant_tag: str | None,
                  weights: bool) -> tuple[str | None, list[str] | None]:
    """(the GGUF file, None) or (None, the allow-patterns of a checkpoint folder; the shard list
    is settled once the index is read). A repo pagedllm cannot load is a ValueError here,
    before anything is downloaded."""
    ggufs = _model_ggufs(files)
    if gguf_file is not None:
        if gguf_file not in files:
            raise ValueError(f"{repo_id} has no file {gguf_file!r}. Its GGUF files: "
                             f"{', '.join(ggufs) if ggufs else 'none'}.")
        _refuse_split(repo_id, gguf_file, files)
        return gguf_file, None
    if quant_tag is not None:
        return choose_gguf(repo_id, files, quant_tag), None
    patterns = list(TOKENIZER_FILES) + list(CONFIG_FILES) + list(POOLING_FILES) + list(PROCESSOR_FILES)
    if not weights and any(f in files for f in ("config.json", "tokenizer.json", "tokenizer_config.json")):
        return None, patterns
    if "config.json" in files:
        if not any(f.endswith(".safetensors") for f in files):
            others = [f for f in files if f.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack"))]
            hint = f" It has {', '.join(others)} (pickled / other formats are not loaded)." if others else ""
            gguf = f" Its GGUF files can be loaded with {repo_id}:TAG: {', '.join(ggufs)}." if ggufs else ""
            raise ValueError(f"{repo_id} has no *.safetensors weights; pagedllm loads safetensors "
                             f"checkpoints and GGUF files.{hint}{gguf}")
        return None, patterns
    if len(ggufs) == 1:
        _refuse_split(repo_id, ggufs[0], files)
        return ggufs[0], None
    if ggufs:
        if len({_gguf_base(f) for f in ggufs}) == 1:
            _refuse_split(repo_id, ggufs[0], files)
        raise ValueError(
            f"{repo_id} holds several GGUF files; name one with {repo_id}:TAG (e.g. "
            f"{repo_id}:Q4_K_M) or gguf_file= / --gguf-file NAME. Its GGUF files: {', '.join(ggufs)}."
        )
    raise ValueError(f"{repo_id} has neither a config.json (a transformers checkpoint) nor a .gguf "
                     f"file. Its files: {', '.join(files) if files else 'none'}.")


def _shards_from_index(repo_id: str, revision, cache: str) -> list[str]:
    """The safetensors files the shard index names (a repo may hold others, e.g. Mistral's
    `consolidated.safetensors`: the same weights again, which would double the download)."""
    # lazy: huggingface_hub (0.2 s) stays out of the CLI's start-up
    from huggingface_hub import hf_hub_download

    index = hf_hub_download(repo_id, SAFETENSORS_INDEX, revision=revision, cache_dir=cache)
    with open(index) as f:
        weight_map = json.load(f).get("weight_map") or {}
    shards = sorted(set(weight_map.values()))
    if not shards:
        raise ValueError(f"{repo_id}: {SAFETENSORS_INDEX} has an empty weight_map.")
    return shards


def _partial_snapshot(repo_id: str, revision: str, commit: str, cache: str, files: list[str],
                      patterns: list[str]) -> ValueError:
    """The error for a cached commit that lacks files this load needs, naming them."""
    # lazy: huggingface_hub (0.2 s) stays out of the CLI's start-up
    from huggingface_hub import constants
    from huggingface_hub.utils import filter_repo_objects

    folder = os.path.join(_repo_cache_folder(repo_id, cache), "snapshots", commit)
    wanted = list(filter_repo_objects(files, allow_patterns=patterns))
    optional = (*TOKENIZER_FILES, *CONFIG_FILES, *POOLING_FILES, *PROCESSOR_FILES, SAFETENSORS_INDEX)
    wanted += [p for p in patterns if p not in wanted and p not in optional]  # indexed, not listed
    missing = [f for f in wanted if not os.path.isfile(os.path.join(folder, f))]
    why = ("offline mode (HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1) forbids downloading them"
           if constants.is_offline_mode() else f"the Hub ({constants.ENDPOINT}) could not be reached")
    return ValueError(
        f"Model {repo_id!r} (revision {revision!r}) is only partly in the Hugging Face cache at {folder}: "
        f"it lacks {', '.join(missing) if missing else 'files this load needs'}, and {why}. Download "
        f"them where the Hub is reachable (`hf download {repo_id} --revision {commit}`)."
    )


def resolve_hub_model(repo_id: str, *, revision: str | None = None, download_dir: str | None = None,
                      gguf_file: str | None = None, quant_tag: str | None = None,
                      weights: bool = True) -> HubSnapshot:
    """Download (or find in the cache) what pagedllm needs of `repo_id` at `revision`.

    `weights=False` fetches the tokenizer side only (`tokenizer=` an id). The revision is
    resolved to one commit first, and every file is taken at that commit, so a push to the
    repo meanwhile cannot mix two versions."""
    # lazy: huggingface_hub (0.2 s) stays out of the CLI's start-up
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    if gguf_file is not None and quant_tag is not None:
        raise ValueError(f"Give either {repo_id}:{quant_tag} or gguf_file={gguf_file!r}, not both.")
    cache = hub_cache_dir(download_dir)
    asked = revision or "main"
    api = HfApi()
    with hub_errors(repo_id, asked, cache):
        # Offline, the cached ref answers at once (no attempt to reach the Hub, no warning).
        resolved = api.resolve_revision(repo_id, revision=revision, cache_dir=cache,
                                        local_files_only=constants.is_offline_mode())
        files, reachable = _repo_files(api, repo_id, resolved, cache)
        chosen, patterns = _choose_files(repo_id, files, gguf_file, quant_tag, weights)
        try:  # from here on the commit is known: what is missing is some of its files
            if chosen is not None:
                patterns = [chosen]
            elif weights:
                shards = (_shards_from_index(repo_id, resolved, cache) if SAFETENSORS_INDEX in files
                          else [f for f in files if f.endswith(".safetensors")])
                patterns = patterns + [SAFETENSORS_INDEX] + shards
            folder = snapshot_download(repo_id, revision=resolved, cache_dir=cache, allow_patterns=patterns,
                                       local_files_only=not reachable)
            # Without a cached tree listing, an offline snapshot is returned as it is: check that
            # the files the load opens (the GGUF, config.json, every indexed shard) are there.
            opened = [chosen] if chosen is not None else (["config.json"] + shards if weights else [])
            if any(not os.path.isfile(os.path.join(folder, f)) for f in opened):
                raise LocalEntryNotFoundError(f"{folder} lacks some of {opened}")
        except LocalEntryNotFoundError as e:
            needed = patterns if not weights or chosen is not None else patterns + [SAFETENSORS_INDEX]
            raise _partial_snapshot(repo_id, asked, resolved.resolved, cache, files, needed) from e
    path = folder
    if chosen is not None and os.path.dirname(chosen):  # `Q4_K_M/x.gguf`: the file's own folder
        path = os.path.join(folder, os.path.dirname(chosen))
        chosen = os.path.basename(chosen)
    return HubSnapshot(repo_id, asked, resolved.resolved, path, chosen)
