"""What continuing an interrupted ``fit`` needs beyond the model: random streams, data order, callbacks.

Saved with ``model.save(..., resumable=True)`` (``BackupAndRestore``,
``ModelCheckpoint(resumable=True)``) and put back by
``model.load(..., resume=True)`` (``fit(resume_from=...)``).
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
from typing import Any, Iterator

import torch

from hapi import distributed
from hapi.checkpoint.errors import CheckpointError
from hapi.rng import set_global_state

_CRAFTED = "it is damaged or was crafted. Resume from another checkpoint, or start afresh."


def _short(value: Any) -> str:
    text = f"a tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def refuse(file: str, where: str, value: Any, expected: str) -> None:
    """A restored field that no run writes: a CheckpointError naming it and its value."""
    raise CheckpointError(f"{file!r} holds {where} = {_short(value)}, not {expected}: {_CRAFTED}")


def count(file: str, state: dict[str, Any], key: str, most: int | None = None) -> int:
    """``state[key]``, a non-negative int (at most ``most``), or a CheckpointError naming it."""
    value = state.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        refuse(file, repr(key), value, "a non-negative int")
    if most is not None and value > most:  # a shortened run, not a damaged file
        raise CheckpointError(
            f"{file!r} was saved at {key} {value}, past this fit's {key}s={most}: pass "
            f"{key}s={value} or more to continue it, or model.load({file!r}) (without "
            "resuming) to start a new fit from its weights."
        )
    return value


@contextlib.contextmanager
def restoring(file: str, where: str) -> Iterator[None]:
    """Any error while ``where`` is put back from ``file`` becomes a CheckpointError naming it.

    What a checkpoint holds is data from outside: a value no run writes
    (``None`` for a tensor, a list for a count) fails deep in torch or in a
    callback with a TypeError or KeyError that names neither the file nor the field.
    """
    try:
        yield
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(
            f"{file!r}: {where} cannot be restored ({type(error).__name__}: {error}); {_CRAFTED}"
        ) from error


def check_like(file: str, saved: Any, reference: Any, where: str, shapes: bool = False) -> None:
    """``saved`` holds the kind of value ``reference`` does wherever both have one.

    ``reference`` is what this run holds in its place (a ``None`` there takes
    anything, a list any length): a state of the wrong kind is refused before
    it is used, not when a later step trips over it. ``shapes``: where
    ``reference`` holds a tensor, ``saved`` holds one of its shape.
    """
    if reference is None:
        return
    if isinstance(reference, dict):
        if not isinstance(saved, dict):
            refuse(file, where, saved, "a dict")
        for key in reference.keys() & saved.keys():
            check_like(file, saved[key], reference[key], f"{where}[{key!r}]", shapes)
        return
    number = (numbers.Real, torch.Tensor)  # a setting may be a float, a NumPy scalar, a tensor
    kinds = ((bool,), number, (str,), (list, tuple))
    kind = next((k for k in kinds if isinstance(reference, k)), (type(reference),))
    if not isinstance(saved, kind) or (isinstance(saved, bool) and bool not in kind):
        refuse(file, where, saved, f"a {type(reference).__name__} as this run's")
    if shapes and torch.is_tensor(reference):
        if not torch.is_tensor(saved) or saved.shape != reference.shape:
            refuse(file, where, saved, f"a tensor of shape {tuple(reference.shape)} as this run's")


def fit_state(
    data_seed: int,
    position: tuple[dict[str, Any], dict[str, Any]],
    rng: dict[str, Any],
    metrics: Any,
    callbacks: Any,
    step_state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What resuming a fit needs beyond the model (collective: every process calls it).

    Random streams and running sums differ between processes, so each rank's
    are kept and each resumes its own. ``position`` is the training data's
    (:meth:`hapi.train_data.TrainData.position`): what decides the epoch's
    order and how far the epoch went into it, which a resume on another
    number of processes continues from, and each process's random states at
    the epoch's start, which a resume on as many replays. ``step_state`` is
    what a ``train_step`` of the user's own carries between batches
    (:func:`step_state`), kept per process like the random streams.
    """
    shared, own = position
    per_rank = {"rng": rng, "metrics": metrics.training_state_dict(), "data": own}
    if step_state is not None:
        per_rank["step_state"] = step_state
    return {
        "data_seed": data_seed,
        "data": shared,
        "per_rank": distributed.gather_objects(per_rank),
        "callbacks": [[type(c).__name__, c.state_dict()] for c in callbacks],
    }


def step_state(model: Any) -> dict[str, Any] | None:
    """What the Model's own step carries between batches, from its ``step_state_dict()``.

    A ``Model`` subclass whose ``train_step`` keeps state from one batch to
    the next (a language model's hidden state in truncated backpropagation
    through time, a running statistic) defines ``step_state_dict()`` returning
    it as a dict, and ``load_step_state_dict(state)`` taking that dict back; a
    resumable checkpoint then holds each process's and a resumed fit restores
    it. ``None`` for a Model that defines neither.
    """
    save = getattr(model, "step_state_dict", None)
    load = getattr(model, "load_step_state_dict", None)
    if save is None and load is None:
        return None
    if save is None or load is None:
        given, missing = (
            ("step_state_dict", "load_step_state_dict")
            if load is None
            else ("load_step_state_dict", "step_state_dict")
        )
        raise TypeError(
            f"{type(model).__name__} defines {given}() but not {missing}(): a resumed fit needs "
            "both to carry the train_step's state over. Define the pair: step_state_dict() "
            "returning a dict, load_step_state_dict(state) taking it back."
        )
    state = save()
    if not isinstance(state, dict):
        raise TypeError(
            f"{type(model).__name__}.step_state_dict() returned {type(state).__name__}; it must "
            "return a dict (of tensors, numbers, strings, lists or dicts), e.g. "
            "{'hidden': self.hidden}."
        )
    return state


def restore_step_state(model: Any, own: dict[str, Any] | None, file: str) -> None:
    """Give the Model's own step its state back from this process's part of a resumable file.

    A file saved without one (by a Model without ``step_state_dict``, or an
    older torch-hapi) leaves the Model's state as it is. The saved dict must
    hold the kinds of value (and tensors of the shapes) ``step_state_dict()``
    returns now, where it returns one that is not ``None``: the step would
    trip over any other later, far from the file.
    """
    if own is None or "step_state" not in own:
        return
    load = getattr(model, "load_step_state_dict", None)
    if load is None:
        warnings.warn(
            f"Resuming from {file!r}: it holds the state a train_step carried between batches "
            f"(keys {sorted(own['step_state'])}), but {type(model).__name__} defines no "
            "load_step_state_dict(state) to take it, so it is not restored. Define "
            "step_state_dict() and load_step_state_dict(state) on the Model subclass.",
            stacklevel=4,
        )
        return
    save = getattr(model, "step_state_dict", None)
    check_like(file, own["step_state"], save and save(), "'step_state'", shapes=True)
    load(own["step_state"])


def check_fitting(restoring: bool) -> None:
    if not restoring:
        raise RuntimeError(
            "load(..., resume=True) continues an interrupted fit, which fit itself does before "
            "its first batch: pass fit(resume_from=path), or keep backups with "
            "callbacks.BackupAndRestore; to start from a file's weights, load without resume=True."
        )


def check_resumable(file: str, state: dict[str, Any]) -> None:
    if "fit" not in state:
        raise CheckpointError(
            f"{file!r} was not saved to resume a fit: it lacks the data order, random states and "
            "callback states that continuing one needs. ModelCheckpoint(..., resumable=True) and "
            "BackupAndRestore write files a fit can resume from. To start a new fit from this "
            f"file's weights instead, call model.load({file!r}) before fit(), with no resume_from."
        )


def _check_fit(file: str, saved: Any) -> None:
    """The fit state's layout: what :func:`fit_state` writes, before any of it is used."""
    if not isinstance(saved, dict) or not {"data_seed", "data", "per_rank", "callbacks"} <= set(
        saved
    ):
        refuse(file, "'fit'", saved, "a dict of 'data_seed', 'data', 'per_rank' and 'callbacks'")
    check_like(file, saved, {"data": {}, "per_rank": [], "callbacks": []}, "'fit'")
    count(file, saved, "data_seed")
    per_rank = saved["per_rank"]
    if not per_rank or not all(isinstance(part, dict) for part in per_rank):
        refuse(file, "'per_rank'", per_rank, "a list of each process's dict")
    for index, entry in enumerate(saved["callbacks"]):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)):
            refuse(file, f"'callbacks'[{index}]", entry, "a [class name, state] pair")
        check_like(file, entry[1], {}, f"'callbacks'[{index}] ({entry[0]}) state")


def restore_fit(
    saved: dict[str, Any], file: str, metrics: Any, callbacks: Any
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Give each process its random streams and running figures, and each callback its state.

    Returns this process's part of the file (``None`` when another number of
    processes wrote it: the per-process parts cannot be matched, and random
    streams and the epoch's running figures start afresh) and rank 0's. Every
    part is checked before it is used; one that no run writes raises
    :class:`CheckpointError` naming it.
    """
    _check_fit(file, saved)
    own = distributed.this_process_part(saved["per_rank"])
    if own is not None:
        where = f"'per_rank'[{distributed.rank()}]"
        with restoring(file, f"{where}['rng']"):
            set_global_state(own["rng"])
        with restoring(file, f"{where}['metrics']"):
            metrics.load_state_dict(own["metrics"])
            metrics.compute(sync=False)  # a running sum of another shape fails here, not later
    callbacks = list(callbacks)
    names = [name for name, _ in saved["callbacks"]]
    ours = [type(c).__name__ for c in callbacks]
    if names != ours:
        warnings.warn(
            f"Resuming from {file!r}: its callbacks {names} differ from this fit's {ours}; "
            "callbacks are matched by class name in order, and the others start afresh.",
            stacklevel=4,
        )
    pending = list(saved["callbacks"])
    for callback in callbacks:
        match = next(
            (i for i, (name, _) in enumerate(pending) if name == type(callback).__name__), None
        )
        if match is not None:
            name, state = pending.pop(match)
            with restoring(file, f"{name}'s state"):
                callback.load_state_dict(state)
    return own, saved["per_rank"][0]


def warn_resume(file: str, saved_by: int, outcome: str, reason: str | None) -> None:
    """One warning when a resumed fit will not equal the uninterrupted one, saying why.

    ``outcome`` is what :meth:`hapi.train_data.TrainData.resume` did.
    """
    here = distributed.world_size()
    epoch = {
        "exact": None,
        "fresh": "random streams start afresh, so results differ from an uninterrupted run",
        "split": (
            f"the rest of the interrupted epoch is split across the processes there are now "
            f"({here}; each remaining sample trained once); random streams and that epoch's "
            "running figures start afresh, so results differ from an uninterrupted run"
        ),
        "restart": (
            f"the interrupted epoch restarts from its first batch, because {reason}; results "
            "differ from an uninterrupted run"
        ),
        "inexact": f"the rest of the interrupted epoch may differ from an uninterrupted run's: {reason}",
    }[outcome]
    if epoch is None:
        return
    moved = f", saved by {saved_by} processes, on {here}" if saved_by != here else ""
    warnings.warn(
        f"Resuming from {file!r}{moved}: the weights, optimizer and callbacks are restored, and "
        f"{epoch}.",
        stacklevel=4,
    )
