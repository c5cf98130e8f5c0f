"""The type and range checks that SamplingParams, BeamSearchParams and the structured-output
parameters share, so that each names the field, the rule and the value in the same words
(vLLM's). A bool is no number here: `True` for an int field is a mistake, not a 1."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

# Beam scores divide by length ** length_penalty: beyond this, any real length over- or
# underflows a float (transformers sets no bound; typical values are 0.5-2).
_LENGTH_PENALTY_MAX = 50.0


def check_length_penalty(value: float) -> None:
    if not -_LENGTH_PENALTY_MAX <= value <= _LENGTH_PENALTY_MAX:
        raise ValueError(f"length_penalty must be in [-{_LENGTH_PENALTY_MAX:g}, "
                         f"{_LENGTH_PENALTY_MAX:g}], got {value}.")


def is_int(x: Any) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def check_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}: {value!r}.")


def as_float(name: str, value: Any) -> float:
    if not is_real(value):
        raise ValueError(f"{name} must be a float, got {type(value).__name__}: {value!r}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}.")
    return value

