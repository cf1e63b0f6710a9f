"""The callbacks of one ``fit``/``evaluate``/``predict``: the user's plus the defaults, in order.

Keras' ``CallbackList(add_history=, add_progbar=)`` in one function: the
progress bar and ``History`` unless the user gave their own, the
``ModelCheckpoint`` of ``fit(save_dir=...)``; then the order some callbacks
need (see :func:`callback_order`).
"""

from __future__ import annotations

from typing import Any

from .base import Callback, CallbackList
from .checkpoint import BackupAndRestore, ModelCheckpoint
from .ema import EMA
from .history import History
from .progbar import ProgBarLogger


def callback_order(callback: Callback) -> int:
    """Where a callback must run among the others (a stable sort keeps the user's order otherwise).

    EMA first: its average is in place before others save or restore at the
    end. Callbacks that save every callback's state run after the rest, so
    that their files hold that state after the batch or epoch saved: a
    resumable ModelCheckpoint, then BackupAndRestore (whose backup also holds
    the ModelCheckpoint's state after that save).
    """
    if isinstance(callback, BackupAndRestore):
        return 3
    if isinstance(callback, ModelCheckpoint) and callback.resumable:
        return 2
    return 0 if isinstance(callback, EMA) else 1


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
    if callbacks is None:
        user: list = []
    elif isinstance(callbacks, Callback):
        user = [callbacks]
    elif isinstance(callbacks, (list, tuple)):
        user = list(callbacks)
    else:
        raise TypeError(
            f"callbacks must be a Callback or a list of them; received {type(callbacks).__name__}."
        )
    # verbose=0 adds no progress bar at all: no per-batch call for a silent display.
    chosen = (
        []
        if verbose == 0 or any(isinstance(c, ProgBarLogger) for c in user)
        else [ProgBarLogger(log_freq=log_freq, verbose=verbose)]
    )
    chosen += user
    if save_dir is not None and not any(isinstance(c, ModelCheckpoint) for c in user):
        chosen.append(ModelCheckpoint(save_dir, save_freq=save_freq))
    if not any(isinstance(c, History) for c in user):
        chosen.append(History())
    chosen.sort(key=callback_order)
    cbks = CallbackList(chosen)
    cbks.set_model(model)
    return cbks
