"""What hapi and the callbacks say to users: the one check of count-like arguments (one
message format), and warnings that point at the user's line.

A leaf module of hapi's (it imports nothing of hapi), so that the callbacks can use it
as they use the checkpoint package's helpers, and the core takes nothing from them.
"""

from __future__ import annotations

import numbers
import os
import sys
import warnings
from typing import Any

# hapi/ and callbacks/ sit side by side: in the repository, and where pip installs them.
_OURS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name, "")
    for name in ("hapi", "callbacks")
)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first caller outside hapi and callbacks.

    A fixed ``stacklevel`` points wherever the calls above it happen to end: the
    same warning comes from ``load()`` called by the user, by ``fit(resume_from=)``
    or by a callback, and a fixed count named hapi's own line for some of them.
    (Python 3.12's ``skip_file_prefixes`` does this walk; torch-hapi runs on 3.10.)
    """
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_OURS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


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
