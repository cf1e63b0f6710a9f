"""What continuing an interrupted ``fit`` needs beyond the model: random streams, data order, callbacks.

Saved with ``model.save(..., resumable=True)`` (``BackupAndRestore``,
``ModelCheckpoint(resumable=True)``) and put back by
``model.load(..., resume=True)`` (``fit(resume_from=...)``).
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch

from hapi import distributed
from hapi.checkpoint.errors import CheckpointError


def rng_state() -> dict[str, Any]:
    """Every random generator's state, in tensors and plain values only."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": [random.getstate()[0], *random.getstate()[1], random.getstate()[2]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    saved_np = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            saved_np["keys"].numpy().astype(np.uint32),
            saved_np["pos"],
            saved_np["has_gauss"],
            saved_np["cached_gaussian"],
        )
    )
    python = state["python"]
    random.setstate((python[0], tuple(python[1:-1]), python[-1]))


def fit_state(
    data_seed: int, epoch_items: int | None, rng: dict[str, Any], metrics: Any, callbacks: Any
) -> dict[str, Any]:
    """What resuming a fit needs beyond the model (collective: every process calls it).

    Random streams and running sums differ between processes, so each rank's
    are kept and each resumes its own. ``epoch_items`` is how far the epoch
    went into its global order of samples, which a resume on another number
    of processes continues from.
    """
    return {
        "data_seed": data_seed,
        "epoch_items": epoch_items,
        "per_rank": distributed.gather_objects({"rng": rng, "metrics": metrics.state_dict()}),
        "callbacks": [[type(c).__name__, c.state_dict()] for c in callbacks],
    }


def check_fitting(fitting: bool) -> None:
    if not fitting:
        raise RuntimeError(
            "load(..., resume=True) continues a fit in progress; call it from a callback's "
            "on_train_begin (callbacks.BackupAndRestore does), or load without resume=True."
        )


def check_resumable(file: str, state: dict[str, Any]) -> None:
    if "fit" not in state:
        raise CheckpointError(
            f"{file!r} was not saved to resume a fit (save(..., resumable=True) during fit, as "
            "BackupAndRestore does), so it lacks the data order, RNG and callback states. Load it "
            "without resume=True to start from its weights."
        )


def restore_fit(saved: dict[str, Any], file: str, metrics: Any, callbacks: Any) -> bool:
    """Give each process its random streams and running figures, and each callback its state.

    Returns False when the file was written by another number of processes:
    the per-process parts cannot be matched, and the caller restarts the
    interrupted epoch.
    """
    own = distributed.own(saved["per_rank"])
    if own is not None:
        set_rng_state(own["rng"])
        metrics.load_state_dict(own["metrics"])
    else:
        epoch = (
            "the rest of the interrupted epoch is split across the processes there are now (each "
            "remaining sample trained once); random streams and that epoch's running figures start "
            "afresh, so results differ from an uninterrupted run"
            if saved.get("epoch_items") is not None
            else "the data splits differently, so the interrupted epoch restarts from its first batch "
            "with fresh random streams; results will differ from an uninterrupted run"
        )
        warnings.warn(
            f"Resuming from {file!r}, saved by {len(saved['per_rank'])} processes, on "
            f"{distributed.world_size()}: the weights, optimizer and callbacks are restored, and "
            f"{epoch}.",
            stacklevel=4,
        )
    callbacks = list(callbacks)
    names = [name for name, _ in saved["callbacks"]]
    if names != [type(c).__name__ for c in callbacks]:
        warnings.warn(
            f"Resuming from {file!r}: its callbacks {names} differ from this fit's "
            f"{[type(c).__name__ for c in callbacks]}; callbacks are matched by class name in "
            "order, and the others start afresh.",
            stacklevel=4,
        )
    pending = list(saved["callbacks"])
    for callback in callbacks:
        match = next(
            (i for i, (name, _) in enumerate(pending) if name == type(callback).__name__), None
        )
        if match is not None:
            callback.load_state_dict(pending.pop(match)[1])
    return own is not None
