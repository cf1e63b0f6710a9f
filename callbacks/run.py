"""The callbacks of one ``fit``/``evaluate``/``predict``: the user's plus the defaults, in order.

Keras' ``CallbackList(add_history=, add_progbar=)`` in one function: the
progress bar and ``History`` unless the user gave their own, the
``ModelCheckpoint`` of ``fit(save_dir=...)``, ``fit(resume_from=...)``; then
the order some callbacks need (see :func:`callback_order`).
"""

from __future__ import annotations

import os
from typing import Any

from tqdm import tqdm

from .base import Callback, CallbackList
from .checkpoint import BackupAndRestore, ModelCheckpoint
from .ema import EMA
from .history import History
from .progbar import ProgBarLogger


class ResumeFrom(Callback):
    """``fit(resume_from=path)``: the fit continues from that file, at the start of training."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = path

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.model.load(self.path, resume=True)
        if self.is_main:  # as BackupAndRestore says it: a resumed fit is no silent one
            model = self.model
            tqdm.write(
                f"Resuming from {os.fspath(self.path)} at epoch {model.epoch + 1}, batch "
                f"{model.epoch_step} (optimizer step {model.step})."
            )


def callback_order(callback: Callback) -> int:
    """Where a callback must run among the others (a stable sort keeps the user's order otherwise).

    EMA first: its average is in place before others save or restore at the
    end. A resumable ModelCheckpoint after the rest, so that its files hold
    their state after the batch or epoch saved. A resume restores the state
    other callbacks reset in ``on_train_begin``, so ``resume_from`` and then
    BackupAndRestore come last (a backup of this very run, if any, is further
    on than ``resume_from``'s file).
    """
    if isinstance(callback, BackupAndRestore):
        return 4
    if isinstance(callback, ResumeFrom):
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
    resume_from: str | os.PathLike | None = None,
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
    if resume_from is not None:
        chosen.append(ResumeFrom(resume_from))
    chosen.sort(key=callback_order)
    cbks = CallbackList(chosen)
    cbks.set_model(model)
    return cbks
