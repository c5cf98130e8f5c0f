"""Functions that stay eager inside torch.compile'd graphs, without importing torch._dynamo at start-up.

`torch.compiler.disable` imports torch._dynamo: about 1 s per process on this project's 2-core
machines, paid by the API server and the engine core (and every tensor-parallel worker) at each
start, though only the opt-in compiled decode graphs (worker/decode_graphs.py) ever compile.
`eager_in_graphs(fn)` returns a forwarder to `fn`; `prepare_for_compilation()`, which the
compiling code calls before its first `torch.compile`, points every forwarder at
`torch.compiler.disable(fn)`. Dynamo inlines the forwarder and stops at the disabled function, as
it did when the decorator was applied at import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_targets: list[tuple[list[Callable[..., Any]], Callable[..., Any]]] = []  # (slot, fn)
_prepared = False


def eager_in_graphs(fn: F) -> F:
    """`fn`, run eagerly (a graph break) when reached inside a compiled graph."""
    slot: list[Callable[..., Any]] = [fn]
    _targets.append((slot, fn))
    if _prepared:
        _disable(slot, fn)

    @functools.wraps(fn)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return slot[0](*args, **kwargs)

    return forward  # type: ignore[return-value]


def prepare_for_compilation() -> None:
    """Apply `torch.compiler.disable` to every `eager_in_graphs` function (imports torch._dynamo)."""
    global _prepared
    _prepared = True
    for slot, fn in _targets:
        _disable(slot, fn)


def _disable(slot: list[Callable[..., Any]], fn: Callable[..., Any]) -> None:
    if slot[0] is fn:
        slot[0] = torch.compiler.disable(fn)
