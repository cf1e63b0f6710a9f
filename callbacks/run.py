"""The callbacks of one ``fit``/``evaluate``/``predict``: the user's plus the defaults, in order.

Keras' ``CallbackList(add_history=, add_progbar=)`` in one function: the
progress bar first and ``History`` last unless the user gave their own, the
``ModelCheckpoint`` of ``fit(save_dir=...)`` after the user's; then each
callback where its own :attr:`Callback.order` puts it (a stable sort: the
given order among equal values).
"""

from __future__ import annotations

from typing import Any

from .base import Callback, CallbackList
from .history import History
from .model_checkpoint import ModelCheckpoint
from .progbar import ProgBarLogger


def callbacks_for_run(
    model: Any,
    callbacks: Any,
    *,
    verbose: int,
    log_freq: int,
    save_dir: str | None = None,
    save_freq: int = 1,
) -> CallbackList:
    """The ``CallbackList`` of one run of ``model``: ``callbacks`` (one or a list) and the defaults."""
    if isinstance(callbacks, Callback):
        callbacks = [callbacks]
    elif not isinstance(callbacks, (list, tuple, type(None))):
        raise TypeError(
            f"callbacks must be a Callback or a list of them; received {type(callbacks).__name__}."
        )
    chosen = list(callbacks or ())
    # verbose=0 adds no progress bar at all: no per-batch call for a silent display.
    if verbose and not any(isinstance(c, ProgBarLogger) for c in chosen):
        chosen.insert(0, ProgBarLogger(log_freq=log_freq, verbose=verbose))
    if save_dir is not None and not any(isinstance(c, ModelCheckpoint) for c in chosen):
        chosen.append(ModelCheckpoint(save_dir, save_freq=save_freq))
    if not any(isinstance(c, History) for c in chosen):
        chosen.append(History())
    cbks = CallbackList(sorted(chosen, key=_order))
    cbks.set_model(model)
    return cbks


def _order(callback: Any) -> float:
    """Where ``callback`` runs (:attr:`Callback.order`), refused unless it is a number."""
    order = getattr(callback, "order", 0)  # a non-Callback is refused by CallbackList
    if isinstance(order, bool) or not isinstance(order, (int, float)):
        raise TypeError(
            f"{type(callback).__name__}.order is {order!r}; Callback.order is a number that says "
            "where a callback runs among the others (lower first, 0 by default). Give your own "
            "attribute another name."
        )
    return order
