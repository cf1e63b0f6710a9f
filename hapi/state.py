"""A run's state in a checkpoint: what ``Model.save`` collects and ``Model.load`` restores.

A checkpoint is a dict of the run's stateful parts: the network, the
optimizer(s), the gradient scaler, the counters (``epoch``, ``epoch_step``,
``step``) and the random generators; a resumable one adds under ``"fit"`` what
continuing an interrupted ``fit`` needs: the data order and position, each
process's random streams and running sums, every callback's ``state_dict``, and
a train step's own state. ``fit`` restores them before its loop starts
(:func:`restore_fit`); nothing rewrites a running loop. Files are written and
read by :mod:`hapi.checkpoint`; every field read from one is checked against
what a run writes before it is used (:func:`refuse`, :func:`check_like`), so a
damaged or crafted file fails naming the field, not later in torch.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import warnings
from typing import Any, Callable, Iterator

import torch
from tqdm import tqdm

from hapi import checkpoint, distributed
from hapi.amp import check_scaler_state
from hapi.checkpoint.errors import CRAFTED, CheckpointError, refuse
from hapi.messages import warn
from hapi.rng import global_state, set_global_state

_PLAIN = (type(None), bool, int, float, str)
_OPTIMIZER_KEYS = ("optimizer", "optimizer_shards")  # a file's, a sharded checkpoint's

_STEP_STATE = ("step_state_dict", "load_step_state_dict")

# The position of a file written before torch-hapi recorded the epoch's order.
_UNKNOWN_POSITION = {"kind": "unknown"}


# -- refusing what no run writes --------------------------------------------------
def count(file: str, state: dict[str, Any], key: str, most: int | None = None) -> int:
    """``state[key]``, a non-negative int (at most ``most``), or a CheckpointError naming it."""
    value = state.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        refuse(file, repr(key), value, "a non-negative int")
    if most is not None and value > most:  # a shortened run, not a damaged file
        raise CheckpointError(
            f"{file!r} was saved at {key} {value}, past this fit's {key}s={most}: pass {key}s="
            f"{value} or more to continue it, or model.load({file!r}) to start anew from it."
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
            f"{file!r}: {where} cannot be restored ({type(error).__name__}: {error}); {CRAFTED}"
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


# -- save ---------------------------------------------------------------------------
def save(model: Any, path: Any, training: bool, resumable: bool, sharded: bool, wait: bool) -> str:
    """:meth:`hapi.Model.save`: the model's parts as one dict, written by :mod:`hapi.checkpoint`."""
    network, strategy, optimizers = model._network, model._strategy, model._optimizers
    distributed.sync_from_main(network)  # what is written is what every process evaluates
    if not (training or sharded):  # the plain state_dict: loads with no torch-hapi
        return checkpoint.save_state(path, strategy._full_state_dict(network), wait=wait)
    if training and sharded and len(optimizers) > 1:
        raise ValueError(
            f"save(sharded=True) holds one optimizer; this Model has {len(optimizers)}. "
            "Save with sharded=False."
        )
    state: dict[str, Any] = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION}
    if not sharded:
        state["network"] = strategy._full_state_dict(network)
    if training:
        full = functools.partial(strategy._full_optimizer_state, network)
        # Without an optimizer, one loaded before prepare() gave it one.
        optimizer, kind = model._pending_optimizer or (None, None)
        if len(optimizers) > 1:  # a train_step of the user's own: every optimizer, by name
            optimizer = kind = None
            state["optimizers"] = {name: full(o) for name, o in optimizers.items()}
            state["optimizer_types"] = {name: type(o).__name__ for name, o in optimizers.items()}
        elif optimizers:
            optimizer = None if sharded else full(model._optimizer)
            kind = type(model._optimizer).__name__
        scaler = model._scaler.state_dict() if model._scaler else model._pending_scaler_state
        state.update(optimizer=optimizer, optimizer_type=kind, scaler=scaler, rng=global_state())
        state.update(epoch=model.epoch, epoch_step=model.epoch_step, step=model.step)
        if resumable and model._fit_run is not None:
            state["fit"] = _fit_state(model, state["rng"])
    if sharded:
        optimizer = model._optimizer if training else None
        return checkpoint.save_sharded(path, state, network, optimizer, wait=wait)
    return checkpoint.save_state(path, state, wait=wait)


def _fit_state(model: Any, rng: dict[str, Any]) -> dict[str, Any]:
    """What resuming a fit needs beyond the model (collective: every process calls it).

    Random streams and running sums differ between processes, so each rank's
    are kept and each resumes its own. The training data's position
    (:meth:`hapi.data.TrainData.position`) is what decides the epoch's
    order and how far the epoch went into it, which a resume on another
    number of processes continues from, and each process's random states at
    the epoch's start, which a resume on as many replays.

    A ``Model`` subclass whose ``train_step`` keeps state from one batch to
    the next (a language model's hidden state in truncated backpropagation
    through time, a running statistic) defines ``step_state_dict()`` returning
    it as a dict, and ``load_step_state_dict(state)`` taking that dict back;
    each process's is kept under ``"step_state"`` and a resumed fit restores it.
    """
    run = model._fit_run
    shared, own = run.train_data.position(model.epoch_step)
    per_rank = {"rng": rng, "metrics": model._metrics.training_state_dict(), "data": own}
    save_, load_ = (getattr(model, name, None) for name in _STEP_STATE)
    if (save_ is None) != (load_ is None):
        given, missing = _STEP_STATE if load_ is None else _STEP_STATE[::-1]
        raise TypeError(
            f"{type(model).__name__} defines {given}() but not {missing}(), and a resumed fit "
            f"needs both to carry the train_step's state over: define {missing}() too."
        )
    if save_ is not None:
        per_rank["step_state"] = step_state = save_()
        if not isinstance(step_state, dict):
            raise TypeError(
                f"{type(model).__name__}.step_state_dict() returned {type(step_state).__name__}; "
                "it must return a dict, e.g. {'hidden': self.hidden}."
            )
    return {
        "data_seed": run.train_data.seed,
        "data": shared,
        "per_rank": distributed.gather_objects(per_rank),
        "callbacks": [[type(c).__name__, c.state_dict()] for c in run.callbacks],
    }


# -- load -----------------------------------------------------------------------------
def load(model: Any, path: Any, skip_mismatch: bool, reset_optimizer: bool, resume: bool) -> None:
    """:meth:`hapi.Model.load`: every part checked, then restored (see its docstring)."""
    run = model._fit_run
    if resume:
        if run is None or not run.restoring:
            raise RuntimeError(
                "load(..., resume=True) is what fit does before its first batch: pass "
                "fit(resume_from=path) instead, or load without resume=True to start from a file."
            )
        file, state = checkpoint.load_freshest_state(path)
        if "fit" not in state:
            raise CheckpointError(
                f"{file!r} was not saved to resume a fit (ModelCheckpoint(..., resumable=True) and "
                "BackupAndRestore write such files); to start a new fit from its weights, call "
                f"model.load({file!r}) before fit()."
            )
    else:
        file, state = checkpoint.load_state(path)
    # The counters first: a value no run writes is refused before anything is changed.
    epoch = count(file, state, "epoch", run.epochs if resume else None)
    epoch_step, step = (count(file, state, key) for key in ("epoch_step", "step"))
    if state.get("optimizer_type") is not None:
        check_like(file, state["optimizer_type"], "", "'optimizer_type'")
    if not (reset_optimizer or skip_mismatch):  # else not restored, or only if it fits
        _check_optimizer_states(model, file, state)
    skipped = _load_weights(model, file, state, skip_mismatch)
    if skipped:
        warn(
            f"Loaded {file!r} partially; skipped {len(skipped)} tensors whose name or "
            f"shape do not match this network: {skipped}.",
        )
    if not reset_optimizer:
        _load_optimizers(model, file, state, skipped, keep_hyperparameters=not resume)
    if state.get("scaler") is not None:
        check_scaler_state(file, state["scaler"])
        if model._scaler is not None:
            with restoring(file, "'scaler'"):
                model._scaler.load_state_dict(state["scaler"])
        else:
            model._pending_scaler_state = state["scaler"]
    model.epoch, model.epoch_step, model.step = epoch, epoch_step, step
    if resume:
        _resume_fit(model, file, state["fit"])


def _load_weights(model: Any, file: str, state: dict, skip_mismatch: bool) -> list[str]:
    """The file's weights into the network, matched by name and shape; returns the keys skipped.

    A sharded checkpoint's are resharded for this run (collectives).

    Raises:
        CheckpointError: unless ``skip_mismatch``, when any key is missing,
            unexpected or of another shape -- the sign of another architecture.
    """
    if "shards" in state:
        from hapi.checkpoint import dcp_io  # imported on first use (DCP costs a second)

        directory = checkpoint.shards_directory(file, state)
        shapes = dcp_io.saved_shapes(directory)  # meta tensors: shapes without their data
        saved = {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}

    else:
        saved = state.get("network")
        check_like(file, saved, {}, "'network'")
        for key, value in saved.items():
            if not (torch.is_tensor(value) or str(key).endswith("_extra_state")):
                refuse(file, f"'network'[{key!r}]", value, "a tensor")
    expected = model._network.state_dict()
    loadable = {k: v for k, v in saved.items() if k in expected and v.shape == expected[k].shape}
    skipped = sorted((set(expected) | set(saved)) - set(loadable))
    if skipped and not skip_mismatch:
        problems = {
            "shape mismatch": ", ".join(
                f"{k}: file {tuple(saved[k].shape)} vs network {tuple(expected[k].shape)}"
                for k in expected
                if k in saved and k not in loadable
            ),
            "missing in the file": [k for k in expected if k not in saved],
            "not in the network": [k for k in saved if k not in expected],
        }
        raise CheckpointError(
            f"Checkpoint {file!r} does not fit this network ({type(model._network).__name__}): "
            f"{'; '.join(f'{what}: {keys}' for what, keys in problems.items() if keys)}. It was "
            "probably saved from another architecture. Load it into the network it came from, "
            "or pass skip_mismatch=True to load only the tensors whose names and shapes match."
        )
    if "shards" in state:
        dcp_io.load_shards(directory, model._network, set(loadable))
    else:
        model._strategy._load_state_dict(model._network, loadable, strict=not skipped)
    return skipped


def _check_optimizer_states(model: Any, file: str, state: dict) -> None:
    """Each saved optimizer state of the layout torch writes, its tensors of their parameters'
    shapes, its settings of this optimizer's types; refused with the entry before any is used."""
    named = [(f"'{key}'", state.get(key), model._optimizer) for key in _OPTIMIZER_KEYS]
    several = state["optimizers"].items() if isinstance(state.get("optimizers"), dict) else ()
    named += [(f"'optimizers'[{n!r}]", s, model._optimizers.get(n)) for n, s in several]

    for where, saved, optimizer in named:
        if saved is None:
            continue
        check_like(file, saved, {"state": {}, "param_groups": []}, where)
        if optimizer is None:
            continue
        settings = optimizer.state_dict()["param_groups"][0]
        shapes = [tuple(p.shape) for group in optimizer.param_groups for p in group["params"]]
        for index, group in enumerate(saved.get("param_groups", [])):
            at = f"{where}['param_groups'][{index}]"
            check_like(file, group, settings, at)
            for name, value in group.items():  # a setting torch leaves None: a plain value
                if settings.get(name, 0) is None and not isinstance(value, _PLAIN):
                    refuse(file, f"{at}[{name!r}]", value, "a plain value")
        # torch's optimizers keep tensors per parameter (and a step count); LBFGS and
        # optimizers of other libraries may keep numbers and lists of tensors too.
        module = type(optimizer).__module__
        lenient = isinstance(optimizer, torch.optim.LBFGS) or not module.startswith("torch.optim")
        expected = "a tensor, a number or a list" if lenient else "a tensor"
        for key, entry in saved.get("state", {}).items():
            check_like(file, entry, {}, f"{where}['state'][{key!r}]")
            shape = shapes[key] if isinstance(key, int) and 0 <= key < len(shapes) else None
            for name, value in entry.items():
                at = f"{where}['state'][{key!r}][{name!r}]"
                items = value if lenient and isinstance(value, (list, tuple)) else [value]
                kinds = (torch.Tensor, type(None)) + (_PLAIN if lenient or name == "step" else ())
                if not all(isinstance(v, kinds) for v in items):
                    refuse(file, at, value, expected)

                if shape and torch.is_tensor(value) and value.dim() and value.shape != shape:
                    refuse(file, at, value, f"a tensor of the parameter's shape {shape}")


def _load_optimizers(
    model: Any, file: str, state: dict, skipped: list[str], keep_hyperparameters: bool
) -> None:
    """The file's optimizer state(s) into the Model's optimizer(s), now or at ``prepare``.

    ``keep_hyperparameters``: the settings given to prepare() win (a load); a
    resume takes the file's too, schedules having changed them.
    """
    saved, shards = (state.get(key) for key in _OPTIMIZER_KEYS)
    kind = state.get("optimizer_type")
    options = {"keep_hyperparameters": keep_hyperparameters}
    load = functools.partial(load_optimizer_state, model, source=file, **options)
    if skipped:  # the optimizer state belongs to other weights
        if saved is not None or shards is not None:
            message = "The optimizer state in the checkpoint was not loaded: the weights differ."
            warn(message)
        return
    if shards is not None and model._optimizer is None:  # read into the optimizer's own state
        warn(
            f"The optimizer state in the sharded checkpoint {file!r} was not loaded: this Model "
            "has no optimizer yet. Call prepare(optimizer=...) before load() to restore it.",
        )
    elif shards is not None:
        from hapi.checkpoint import dcp_io  # imported on first use (DCP costs a second)

        directory, network = checkpoint.shards_directory(file, state), model._network
        read = functools.partial(dcp_io.load_optimizer_shards, directory, network, model._optimizer)
        load(shards, kind, loader=read)
    elif saved is not None and model._optimizer is None:
        model._pending_optimizer = (saved, kind)
    elif saved is not None:
        load(saved, kind)
    several = state.get("optimizers")
    if several is None:
        return
    with restoring(file, "'optimizers'"):
        if sorted(several) != sorted(model._optimizers):
            warn(
                f"{file!r} holds the states of optimizers {sorted(several)}, but this Model was "
                f"prepared with {sorted(model._optimizers) or 'none'}; they were not loaded. Call "
                "prepare() with the same optimizers (by name, or a list in order) before load().",
            )
            return
        for name, saved_state in several.items():
            optimizer, kind = model._optimizers[name], state["optimizer_types"][name]
            load(saved_state, kind, source=f"{file} ({name!r})", optimizer=optimizer)


def load_optimizer_state(
    model: Any,
    optimizer_state: dict,
    saved_type: str | None,
    *,
    source: str,
    keep_hyperparameters: bool,
    optimizer: torch.optim.Optimizer | None = None,
    loader: Callable[[dict], None] | None = None,
) -> None:
    """A saved state into ``optimizer`` (default: the Model's), refusing one of another class.

    ``loader(state)`` puts it in; by default the strategy's way (sharded under
    FSDP). Its groups must hold as many parameters as the optimizer's (a
    sharded checkpoint's loader would take others), and a per-parameter state
    was kept under settings that keep the same (:func:`check_state_keys`;
    always for a sharded checkpoint's, which takes the file's settings on a
    resume too). With ``keep_hyperparameters`` the optimizer's own settings
    (``lr``, ``betas``, ``weight_decay``, ...: what the user passed to
    ``prepare``) stay, and only the per-parameter state (momentum buffers,
    Adam's moments and step counts) comes from the file; a warning names each
    setting the file had otherwise. torch's ``load_state_dict`` would silently
    take the file's: fine-tuning at 1e-4 from a checkpoint trained at 1e-3
    would train at 1e-3.
    """
    optimizer = model._optimizer if optimizer is None else optimizer
    load = loader or functools.partial(
        model._strategy._load_optimizer_state, model._network, optimizer
    )
    given = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    try:
        if saved_type is not None and saved_type != type(optimizer).__name__:
            raise ValueError(f"it was saved from a {saved_type} optimizer")
        # A state from another optimizer class would load without complaint and
        # fail at the next step; its hyper-parameters give it away.
        groups = optimizer_state.get("param_groups") or [{}]
        lacking = sorted(set(optimizer.defaults) - set(groups[0]))
        if lacking:
            raise ValueError(f"it was saved from another optimizer (its settings lack {lacking})")
        sizes = [len(group.get("params", ())) for group in groups]
        ours = [len(group["params"]) for group in optimizer.param_groups]
        if sizes != ours:
            raise ValueError(
                f"its parameter groups hold {sizes} parameters, this optimizer's {ours}"
            )
        sharded = optimizer_state.get("plain_values") or optimizer_state.get("has_tensors")
        if sharded or (keep_hyperparameters and optimizer_state.get("state")):
            check_state_keys(optimizer, groups, optimizer_state.get("state"))
        load(optimizer_state)
    except CheckpointError:
        raise  # the shards could not be read: says so itself
    except Exception as error:  # noqa: BLE001 -- a crafted state fails anywhere: name it
        raise CheckpointError(
            f"The optimizer state in {source} does not fit this model's optimizer "
            f"({type(optimizer).__name__}): {error}. Pass reset_optimizer=True to load weights only."
        ) from error
    if not keep_hyperparameters:
        return
    differences = []
    for index, (group, settings) in enumerate(zip(optimizer.param_groups, given)):
        for key, value in settings.items():
            if key in group and not _same_setting(group[key], value):
                where = f"group {index} " if len(given) > 1 else ""
                differences.append(f"{where}{key}={group[key]!r} in the file, {value!r} given")
        group.update(settings)
    if differences:
        warn(
            f"The optimizer state loaded from {source} was saved with other settings than the "
            f"{type(optimizer).__name__} given to prepare(): {'; '.join(differences)}. Training uses "
            "the settings given to prepare(); the per-parameter state (momentum, moments, step "
            "counts) comes from the file. To train with the file's settings, build the optimizer "
            "with them.",
        )


def _same_setting(saved: Any, given: Any) -> bool:
    if isinstance(saved, (tuple, list)) and isinstance(given, (tuple, list)):
        return len(saved) == len(given) and all(map(_same_setting, saved, given))
    try:
        return bool(saved == given)  # a one-element tensor compares too
    except (TypeError, ValueError, RuntimeError):
        return saved is given


# Settings that choose an implementation or a device, never the state's keys: left at
# values a throwaway copy on CPU accepts (fused=True, say, needs a GPU).
_IMPLEMENTATION = {"foreach": None, "fused": None, "capturable": False, "differentiable": False}


def _state_keys(kind: type, settings: dict[str, Any], ndim: int) -> frozenset[str] | None:
    """The per-parameter state keys a first step of ``kind(settings)`` creates, for a parameter
    of ``ndim`` dimensions; None when such a copy cannot be made or stepped (an optimizer
    of the user's with other arguments, LBFGS' closure, SparseAdam's sparse gradients)."""
    parameter = torch.zeros((1,) * ndim, requires_grad=True)
    parameter.grad = torch.ones_like(parameter)
    plain = {k: v for k, v in _IMPLEMENTATION.items() if k in settings}
    try:
        copy = kind([{**settings, **plain, "params": [parameter]}])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            copy.step()
    except Exception:  # noqa: BLE001 -- nothing to learn from this optimizer: no check
        return None
    return frozenset(copy.state[parameter])


def check_state_keys(
    optimizer: torch.optim.Optimizer,
    saved_groups: list[dict[str, Any]],
    state: dict[Any, Any] | None = None,
) -> None:
    """Refuse a saved per-parameter state of other keys than a step of ``optimizer`` creates.

    ``saved_groups``: the file's settings, group by group, for a file that
    holds per-parameter state. First a setting that explains it: one differs
    from prepare()'s, and a first step with the file's value creates other
    state keys than with prepare()'s, for a parameter of this group's shapes
    (the state lacks what the first update reads, or holds what it never
    updates). Then, given the file's ``state`` (by parameter index), any
    parameter's keys that differ without such a setting: a damaged or crafted
    file, or another version of the optimizer.

    Raises:
        ValueError: naming the setting(s), the file's value, prepare()'s value
            and what to do; or the keys held and those a step creates.
    """
    kind = type(optimizer)
    for index, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        given = {k: v for k, v in group.items() if k != "params"}
        needed = functools.cache(lambda ndim, given=given: _state_keys(kind, given, ndim))
        differing = [k for k in given if k in saved and not _same_setting(saved[k], given[k])]
        for ndim in {p.ndim for p in group["params"]} if differing else ():
            swapped = {k: _state_keys(kind, {**given, k: saved[k]}, ndim) for k in differing}
            blamed = [k for k in differing if swapped[k] != needed(ndim)]

            if needed(ndim) is None or not blamed:
                continue
            kept = _state_keys(kind, {**given, **{k: saved[k] for k in blamed}}, ndim)
            where = f"group {index}: " if len(optimizer.param_groups) > 1 else ""
            in_file = ", ".join(f"{k}={saved[k]!r}" for k in blamed)
            raise ValueError(
                f"{where}{in_file} in the file, {', '.join(f'{k}={given[k]!r}' for k in blamed)} "
                f"given to prepare(): {kind.__name__} then keeps other per-parameter state "
                f"({sorted(kept or ())}, not {sorted(needed(ndim))}), which the first update "
                f"would trip over. Build the optimizer with {in_file} to continue from this state"
            )
        for parameter, key in zip(group["params"], saved.get("params", []) if state else ()):
            keys = set(state.get(key) or ())
            if keys and needed(parameter.ndim) is not None and keys != needed(parameter.ndim):
                raise ValueError(
                    f"its per-parameter state holds {sorted(keys)}, but a step of this "
                    f"{kind.__name__} creates {sorted(needed(parameter.ndim))} (the file is "
                    f"damaged, or was saved by another version of {kind.__name__})"
                )


# -- resume -------------------------------------------------------------------------
def restore_fit(model: Any, resume_from: str | os.PathLike | None) -> None:
    """Continue an interrupted fit, after every callback's ``on_train_begin`` and before the
    first batch: from ``resume_from``, then from a backup a callback keeps (its
    ``restore_backup()``, as :class:`callbacks.BackupAndRestore` has), the later winning.

    The loop then starts at the restored epoch and step; nothing rewrites it once it runs.
    """
    run = model._fit_run
    run.restoring = True
    try:
        if resume_from is not None:
            model.load(resume_from, resume=True)
            if distributed.is_main():  # as BackupAndRestore says it: no silent resume
                tqdm.write(
                    f"Resuming from {os.fspath(resume_from)} at epoch {model.epoch + 1}, batch "
                    f"{model.epoch_step} (optimizer step {model.step})."
                )
        for callback in run.callbacks:
            restore_backup = getattr(callback, "restore_backup", None)
            if callable(restore_backup):
                restore_backup()
    finally:
        run.restoring = False


def _resume_fit(model: Any, file: str, saved: Any) -> None:
    """Put the fit about to run back where the file left it.

    Each process restores its own part of the file: one refused on one
    process is raised on every process (one collective), none left waiting.
    """
    run, failure = model._fit_run, None
    try:
        own = _restore_parts(model, file, saved)
        run.train_data.seed = saved["data_seed"]
        with restoring(file, "the data position ('data')"):  # a tensor for a dict fails at `or`
            position, mine = saved.get("data") or _UNKNOWN_POSITION, own and own.get("data")
            first = saved["per_rank"][0].get("data") or {"generators": {}}  # rank 0's part
            model.epoch_step, outcome, reason = run.train_data.resume(
                position, mine, first, model.epoch, model.epoch_step
            )
    except CheckpointError as error:
        failure = error
    refused = list(filter(None, distributed.gather_objects(failure and str(failure))))

    if refused:
        raise failure or CheckpointError(refused[0])
    if outcome == "exact":
        return
    # One warning when the resumed fit will not equal the uninterrupted one, saying why
    # (outcome: what hapi.data.TrainData.resume did).
    here, saved_by = distributed.world_size(), len(saved["per_rank"])
    epoch = {
        "fresh": "random streams start afresh",
        "split": (
            f"the rest of the interrupted epoch is split across the processes there are now "
            f"({here}; each remaining sample trained once), random streams and running sums afresh"
        ),
        "restart": f"the interrupted epoch restarts from its first batch, because {reason}",
        "inexact": f"the rest of the interrupted epoch may be read otherwise, because {reason}",
    }[outcome]
    moved = f", saved by {saved_by} processes, on {here}" if saved_by != here else ""
    warn(
        f"Resuming from {file!r}{moved}: the weights, optimizer and callbacks are restored, but "
        f"{epoch}: results can differ from an uninterrupted run.",
    )


def _restore_parts(model: Any, file: str, saved: Any) -> dict[str, Any] | None:
    """Give this process its random streams, running sums and step state, each callback its state.

    Returns this process's part of the file (``None`` when another number of
    processes wrote it: the per-process parts cannot be matched, and random
    streams and the epoch's running sums start afresh). Every part is checked
    (the layout :func:`_fit_state` writes) before it is used; one that no run
    writes raises :class:`CheckpointError` naming it.
    """
    check_like(file, saved, {"data": {}, "per_rank": [], "callbacks": []}, "'fit'")
    if not {"data_seed", "data", "per_rank", "callbacks"} <= set(saved):
        refuse(file, "'fit'", saved, "a dict of 'data_seed', 'data', 'per_rank' and 'callbacks'")
    count(file, saved, "data_seed")
    if not saved["per_rank"] or not all(isinstance(part, dict) for part in saved["per_rank"]):
        refuse(file, "'per_rank'", saved["per_rank"], "a list of each process's dict")
    for index, entry in enumerate(saved["callbacks"]):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)):
            refuse(file, f"'callbacks'[{index}]", entry, "a [class name, state] pair")
        check_like(file, entry[1], {}, f"'callbacks'[{index}] ({entry[0]}) state")
    own = distributed.this_process_part(saved["per_rank"])
    if own is not None:
        where = f"'per_rank'[{distributed.rank()}]"
        with restoring(file, f"{where}['rng']"):
            set_global_state(own["rng"])
        with restoring(file, f"{where}['metrics']"):
            model._metrics.load_state_dict(own["metrics"])
            model._metrics.compute(sync=False)  # a running sum of another shape fails here
    pending = list(saved["callbacks"])
    names = [name for name, _ in pending]
    ours = [type(c).__name__ for c in model._fit_run.callbacks]
    if names != ours:
        warn(
            f"Resuming from {file!r}: its callbacks {names} differ from this fit's {ours}; "
            "callbacks are matched by class name in order, and the others start afresh.",
        )
    for callback in model._fit_run.callbacks:  # the first entry of its class not yet taken
        found = [i for i, (name, _) in enumerate(pending) if name == type(callback).__name__]
        if found:
            name, callback_state = pending.pop(found[0])
            with restoring(file, f"{name}'s state"):
                callback.load_state_dict(callback_state)

    if own is None or "step_state" not in own:  # the Model's own state stays as it is
        return own
    save_, load_ = (getattr(model, name, None) for name in _STEP_STATE)
    if load_ is None:
        warn(
            f"Resuming from {file!r}: its train_step state (keys {sorted(own['step_state'])}) is "
            f"not restored: {type(model).__name__} defines no load_step_state_dict(state) to "
            "take it. Define one beside step_state_dict() on the Model subclass.",
        )
        return own
    # Of the kinds (and tensors of the shapes) step_state_dict() returns now: the step
    # would trip over any other later, far from the file.
    with restoring(file, "'step_state'"):
        check_like(file, own["step_state"], save_ and save_(), "'step_state'", shapes=True)
        load_(own["step_state"])
    return own
