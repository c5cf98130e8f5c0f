"""LoRA adapters as models of the server (vLLM's surface, docs/lora.md).

`--lora-modules name=path ...` (or vLLM's JSON form `{"name", "path", "base_model_name"}`)
names adapters at start-up; each is a model in `/v1/models` whose `parent` is the base model,
and a request picks one by its `model` field. With `--allow-runtime-lora-updating` (or
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`, vLLM's variable; `PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING`)
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter
{"lora_name"}` change them while the server runs (behind the API key like every /v1 route).

Every adapter is checked and loaded by each engine core (`EngineCore.add_lora`, a utility call)
before its name is served: a bad adapter is a 400 naming the problem, and the running requests
never see it. Names map to vLLM's `lora_int_id`s, given in order from 1.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from pagedllm import envs
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger("pagedllm.server")

RUNTIME_UPDATING_ENVS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed(flag: bool) -> bool:
    """The flag, or either environment variable set to 1 / true (as vLLM reads its own)."""
    return flag or any(envs.read(v) for v in RUNTIME_UPDATING_ENVS)


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModulePath]:
    """`--lora-modules` values: `name=path` or a JSON object with name, path and optionally
    base_model_name. A malformed one is a ValueError naming it."""
    modules: list[LoRAModulePath] = []
    for value in values or ():
        value = value.strip()
        if value.startswith("{"):
            try:
                obj = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {value!r}: not valid JSON ({exc.msg})") from None
            unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
            if unknown or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
                raise ValueError(f"--lora-modules {value!r}: a JSON module has a string 'name' and 'path' "
                                 f"(and optionally 'base_model_name'){'; unknown: ' + str(unknown) if unknown else ''}")
            modules.append(LoRAModulePath(obj["name"], obj["path"], obj.get("base_model_name")))
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object")
            modules.append(LoRAModulePath(name, path))
    names = [m.name for m in modules]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora-modules names {dup} more than once")
    return modules


class ServedLoRAs:
    """The adapters this server serves, by name."""

    def __init__(self, async_engine, base_names: list[str], enabled: bool, runtime_updating: bool) -> None:
        self.engine = async_engine
        self.base_names = list(base_names)
        self.enabled = enabled
        self.runtime_updating = runtime_updating
        self.by_name: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        self._next_id = 1

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for an unknown name."""
        if model is None or model in self.base_names:
            return None
        lora = self.by_name.get(model)
        if lora is None:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, param="model")
        return lora

    def cards(self) -> list[tuple[str, str, str]]:
        """(id, root path, parent) of every adapter, for /v1/models."""
        return [(name, lora.lora_path, self.parents[name]) for name, lora in self.by_name.items()]

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check and load an adapter on every engine core, then serve it under `name`."""
        if not self.enabled:
            raise OpenAIError("LoRA is not enabled: start the server with --enable-lora.", 400)
        if not name or not path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' are required.", 400)
        if name in self.by_name or name in self.base_names:
            raise OpenAIError(f"The lora adapter '{name}' has already been loaded.", 400, param="lora_name")
        if base_model_name is not None and base_model_name not in self.base_names:
            raise OpenAIError(f"base_model_name {base_model_name!r} is not a model of this server "
                              f"({self.base_names}).", 400)
        if not os.path.isdir(path):
            raise OpenAIError(f"lora_path {path!r} is not a local directory (adapters load only from "
                              "local folders).", 400, param="lora_path")
        lora = LoRARequest(lora_name=name, lora_int_id=self._next_id, lora_path=os.path.abspath(path),
                           base_model_name=base_model_name)
        self._next_id += 1
        loaded: list[int] = []
        try:
            for index in self._engine_indices():
                await self.engine.call_utility("add_lora", _as_dict(lora), engine_index=index)
                loaded.append(index)
        except RuntimeError as exc:  # the core's ValueError text: a bad adapter
            for index in loaded:
                await self.engine.call_utility("remove_lora", lora.lora_int_id, engine_index=index)
            raise OpenAIError(f"Failed to load LoRA adapter {name!r}: {exc}", 400) from None
        self.by_name[name] = lora
        self.parents[name] = base_model_name or self.base_names[0]
        logger.info("LoRA adapter %r (id %d) served from %s", name, lora.lora_int_id, lora.lora_path)
        return lora

    async def unload(self, name: str | None, lora_int_id: int | None = None) -> None:
        """Stop serving an adapter; requests already running with it finish."""
        if not name and lora_int_id is not None:
            name = next((n for n, lora in self.by_name.items() if lora.lora_int_id == lora_int_id), None)
        lora = self.by_name.pop(name, None) if name else None
        if lora is None:
            raise OpenAIError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name")
        self.parents.pop(name, None)
        for index in self._engine_indices():
            await self.engine.call_utility("remove_lora", lora.lora_int_id, engine_index=index)

    def _engine_indices(self) -> list[int]:
        return [i for i in range(len(self.engine.clients)) if i not in self.engine.dead_engines]


def _as_dict(lora: LoRARequest) -> dict:
    return {"lora_name": lora.lora_name, "lora_int_id": lora.lora_int_id, "lora_path": lora.lora_path,
            "base_model_name": lora.base_model_name}
