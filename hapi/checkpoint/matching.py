"""A saved state against this model: tensors matched by name and shape, optimizer states and settings.

Used by ``Model.load``: errors name the missing, unexpected and reshaped keys
and the fix; an optimizer state keeps the settings given to ``prepare``
unless a fit resumes.
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
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [
        f"{k}: file {tuple(saved[k].shape)} vs network {tuple(expected[k].shape)}"
        for k in expected
        if k in saved and saved[k].shape != expected[k].shape
    ]
    if (missing or unexpected or reshaped) and not skip_mismatch:
        problems = []
        if reshaped:
            problems.append(f"shape mismatch: {', '.join(reshaped)}")
        if missing:
            problems.append(f"missing in the file: {missing}")
        if unexpected:
            problems.append(f"not in the network: {unexpected}")
        raise CheckpointError(
            f"Checkpoint {file!r} does not fit this network ({type(network).__name__}): "
            f"{'; '.join(problems)}. It was probably saved from another architecture. "
            "Load it into the network it came from, or pass skip_mismatch=True to load "
            "only the tensors whose names and shapes match."
        )
    loadable = {k: v for k, v in saved.items() if k in expected and v.shape == expected[k].shape}
    skipped = sorted(
        set(missing) | set(unexpected) | {k for k in saved if k in expected and k not in loadable}
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
        (load or optimizer.load_state_dict)(optimizer_state)
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
    if torch.is_tensor(saved) or torch.is_tensor(given):
        return (
            torch.is_tensor(saved)
            and torch.is_tensor(given)
            and torch.equal(saved.cpu(), given.cpu())
        )
    try:
        return bool(saved == given) or (
            isinstance(saved, (tuple, list)) and list(saved) == list(given)
        )
    except (TypeError, ValueError, RuntimeError):
        return saved is given
