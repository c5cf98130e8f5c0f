"""A request's one output constraint (vLLM's `StructuredOutputsParams`), checked when it is
made: which kind, well-formed, and a JSON schema no deeper than xgrammar can parse in time.

Compiling the constraint is `pagedllm.structured_output`'s job (xgrammar); this module only
describes it, so that the server and `SamplingParams` can hold one without xgrammar.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

# A JSON schema's nesting (objects and arrays) at most this deep: xgrammar's schema parse is
# about cubic in the depth (400 levels: 3.9 s, 900: 35 s on this project's CPU), real schemas
# are a few levels deep.
MAX_SCHEMA_DEPTH = 128


def _nesting_depth(value: Any) -> int:
    """How deeply objects and arrays nest in `value` (iterative: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


@dataclass
class StructuredOutputsParams:
    """One output constraint for a request (vLLM's `StructuredOutputsParams`, its names).

    Exactly one of `json` (a JSON schema, as a dict or a JSON string), `regex`, `choice` (the
    output is one of these strings), `grammar` (EBNF / GBNF, root rule `root`), `json_object`
    (any JSON object) or `structural_tag` (xgrammar's structural tag, a dict or JSON string) is
    set; anything else is a ValueError here. `disable_any_whitespace`: JSON modes follow one
    fixed layout (`{"a": 1, "b": 2}`) instead of allowing any whitespace between tokens, which
    small models may fill with newlines. The engine compiles the
    constraint with xgrammar (`pagedllm.structured_output`; `pip install pagedllm[structured]`).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False

    _KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        given = [k for k in self._KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {given or 'none'}."
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
                except RecursionError:  # json's C parser stops at Python's recursion limit
                    raise ValueError("structured_outputs.json is nested too deeply.") from None
                if not isinstance(parsed, (dict, bool)):
                    raise ValueError("structured_outputs.json must be a JSON schema object.")
            elif not isinstance(self.json, dict):
                raise ValueError(
                    "structured_outputs.json must be a JSON schema (dict or JSON string), got "
                    f"{type(self.json).__name__}."
                )
            else:
                parsed = self.json
            depth = _nesting_depth(parsed)
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(
                    f"structured_outputs.json is nested too deeply: {depth} levels of objects "
                    f"and arrays, at most {MAX_SCHEMA_DEPTH} (xgrammar's parse time grows with "
                    "the cube of the depth)."
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    "structured_outputs.choice must be a non-empty list of non-empty strings, "
                    f"got {self.choice!r}."
                )
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}.")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError("structured_outputs.structural_tag must be a dict or a JSON string.")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool.")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of `_KINDS`."""
        return next(k for k in self._KINDS if getattr(self, k) is not None)

    def cache_key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, whitespace flag): equal constraints compile once."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            value = _json.dumps(value, sort_keys=True)
        return self.kind, str(value), self.disable_any_whitespace

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        """From a request's `structured_outputs` object; an unknown key is refused by name."""
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(data).__name__}.")
        known = set(cls._KINDS) | {"disable_any_whitespace"}
        unknown = sorted(k for k, v in data.items() if k not in known and v is not None)
        if unknown:
            raise ValueError(
                f"structured_outputs field(s) {unknown} are not supported (supported: "
                f"{sorted(known)})."
            )
        return cls(**{k: v for k, v in data.items() if k in known})
