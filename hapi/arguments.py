"""The one check of count-like arguments, for hapi and callbacks alike (one message format).

A leaf module of hapi's (it imports nothing of hapi), so that the callbacks can use it
as they use the checkpoint package's helpers, and the core takes nothing from them.
"""

from __future__ import annotations

import numbers
from typing import Any


def require_int(
    owner: str, name: str, value: Any, minimum: int = 1, allow_none: bool = False
) -> int | None:
    """Return ``value`` if it is an int >= ``minimum`` (or None when allowed); raise ValueError otherwise.

    ``bool`` is refused although it is an ``int`` subclass: ``patience=True``
    is a mistake, not a request for patience 1. The message names the owner
    (``fit``, ``EarlyStopping``...), the argument, what it must be, what was
    received and an example.
    """
    if allow_none and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        kind = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(
            f"{owner}: {name} must be {kind}{' or None' if allow_none else ''}; received {value!r} "
            f"({type(value).__name__}). Pass e.g. {name}={max(minimum, 1)}."
        )
    return int(value)
