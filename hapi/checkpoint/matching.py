"""A saved state against this model: tensors matched by name and shape, optimizer states and settings.

Used by ``Model.load``: errors name the missing, unexpected and reshaped keys
and the fix; an optimizer state keeps the settings given to ``prepare``
unless a fit resumes. Some settings decide which per-parameter state an
optimizer keeps (Adam's ``amsgrad`` adds ``max_exp_avg_sq``, RMSprop's
``centered`` ``grad_avg``): a state saved with another value lacks what the
first update reads, or holds what it never updates, so those must match
(:func:`check_state_keys`). Which settings do is found out, not listed: a
step of a throwaway copy of the optimizer, on a one-element parameter, shows
the state keys its settings create.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch import nn

from hapi.checkpoint.errors import CheckpointError


def match_state_dict(
    network: nn.Module, saved: dict[str, torch.Tensor], file: str, skip_mismatch: bool
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Check ``saved`` against ``network``; returns the loadable part and the skipped keys.

    Raises:
        CheckpointError: unless ``skip_mismatch``, when any key is missing,
            unexpected or of another shape -- the sign of another architecture.
    """
    expected = network.state_dict()
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
            f"Checkpoint {file!r} does not fit this network ({type(network).__name__}): "
            f"{'; '.join(f'{what}: {keys}' for what, keys in problems.items() if keys)}. It was "
            "probably saved from another architecture. Load it into the network it came from, "
            "or pass skip_mismatch=True to load only the tensors whose names and shapes match."
        )
    return loadable, skipped


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    optimizer_state: dict,
    saved_type: str | None,
    source: str,
    load: Callable[[dict], None] | None = None,
    keep_hyperparameters: bool = False,
) -> None:
    """Load a saved optimizer state, refusing one from another optimizer class.

    ``load(state)`` puts it in (the strategy's way: sharded under FSDP);
    by default ``optimizer.load_state_dict``. With ``keep_hyperparameters``
    the optimizer's own settings (``lr``, ``betas``, ``weight_decay``, ...:
    what the user passed to ``prepare``) stay, and only the per-parameter
    state (momentum buffers, Adam's moments and step counts) comes from the
    file; a warning names each setting the file had otherwise. torch's
    ``load_state_dict`` would silently take the file's: fine-tuning at 1e-4
    from a checkpoint trained at 1e-3 would train at 1e-3.
    """
    given = [
        {key: value for key, value in group.items() if key != "params"}
        for group in optimizer.param_groups
    ]
    try:
        if saved_type is not None and saved_type != type(optimizer).__name__:
            raise ValueError(f"it was saved from a {saved_type} optimizer")
        # A state from another optimizer class would load without complaint and
        # fail at the next step; its hyper-parameters give it away.
        groups = optimizer_state.get("param_groups") or [{}]
        lacking = sorted(set(optimizer.defaults) - set(groups[0]))
        if lacking:
            raise ValueError(f"it was saved from another optimizer (its settings lack {lacking})")
        if keep_hyperparameters and optimizer_state.get("state"):
            check_state_keys(optimizer, groups)
            _check_file_keys(optimizer, optimizer_state)
        (load or optimizer.load_state_dict)(optimizer_state)
    except CheckpointError:
        raise  # the shards could not be read: says so itself
    except (ValueError, KeyError, RuntimeError) as error:
        raise CheckpointError(
            f"The optimizer state in {source} does not fit this model's optimizer "
            f"({type(optimizer).__name__}): {error}. Pass reset_optimizer=True to load only the "
            "network's weights."
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
        warnings.warn(
            f"The optimizer state loaded from {source} was saved with other settings than the "
            f"{type(optimizer).__name__} given to prepare(): {'; '.join(differences)}. Training uses "
            "the settings given to prepare(); the per-parameter state (momentum, moments, step "
            "counts) comes from the file. To train with the file's settings, build the optimizer "
            "with them.",
            stacklevel=3,
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


def _check_file_keys(optimizer: torch.optim.Optimizer, optimizer_state: dict) -> None:
    """Refuse a file's per-parameter state whose keys differ from those a step of ``optimizer``
    creates, where no setting explains it (:func:`check_state_keys` names one that does):
    a damaged or crafted file, or another version of the optimizer. Loaded, it would fail
    at the first update, or silently start part of the state afresh."""
    state, kind = optimizer_state.get("state") or {}, type(optimizer)
    for group, saved in zip(optimizer.param_groups, optimizer_state.get("param_groups", [])):
        given = {k: v for k, v in group.items() if k != "params"}
        known: dict[int, frozenset[str] | None] = {}
        for parameter, index in zip(group["params"], saved.get("params", [])):
            keys = set(state.get(index) or ())
            if keys and parameter.ndim not in known:
                known[parameter.ndim] = _state_keys(kind, given, parameter.ndim)
            needed = known.get(parameter.ndim) if keys else None
            if needed is not None and keys != needed:
                raise ValueError(
                    f"its per-parameter state holds {sorted(keys)}, but a step of this "
                    f"{kind.__name__} creates {sorted(needed)} (the file is damaged, or was "
                    f"saved by another version of {kind.__name__})"
                )


def check_state_keys(optimizer: torch.optim.Optimizer, saved_groups: list[dict[str, Any]]) -> None:
    """Refuse a saved per-parameter state kept under settings that make ``optimizer`` keep another.

    ``saved_groups``: the file's settings, group by group, for a file that
    holds per-parameter state. A setting differs from prepare()'s and a first
    step with the file's value creates other state keys than with prepare()'s,
    for a parameter of this group's shapes: the state lacks what the first
    update reads, or holds what it never updates.

    Raises:
        ValueError: naming the setting(s), the file's value, prepare()'s value
            and what to do.
    """
    kind = type(optimizer)
    for index, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        given = {k: v for k, v in group.items() if k != "params"}
        differing = [k for k in given if k in saved and not _same_setting(saved[k], given[k])]
        for ndim in {p.ndim for p in group["params"]} if differing else ():
            needed = _state_keys(kind, given, ndim)
            blamed = [
                k for k in differing if _state_keys(kind, {**given, k: saved[k]}, ndim) != needed
            ]
            if needed is None or not blamed:
                continue
            kept = _state_keys(kind, {**given, **{k: saved[k] for k in blamed}}, ndim)
            where = f"group {index}: " if len(optimizer.param_groups) > 1 else ""
            in_file = ", ".join(f"{k}={saved[k]!r}" for k in blamed)
            raise ValueError(
                f"{where}{in_file} in the file, {', '.join(f'{k}={given[k]!r}' for k in blamed)} "
                f"given to prepare(): with it {kind.__name__} keeps other per-parameter state "
                f"({sorted(kept or ())} with the file's settings, {sorted(needed)} with "
                "prepare()'s), so the first update would fail or start part of that "
                f"state afresh. Build the optimizer with {in_file} to continue from this state"
            )
