"""A sharded checkpoint's tensors through ``torch.distributed.checkpoint`` (DCP): every process writes its own.

What DCP stores is tensors only -- the network's state and the tensors of
the optimizer state, each process writing the shards it holds (replicated
tensors once) -- in one directory per save. Everything else (optimizer
hyper-parameters, non-tensor optimizer values, counters, RNG states) goes to
the checkpoint's manifest, written by :mod:`hapi.checkpoint.sharded` like any file.
DCP reshards on reading: a directory saved by 2 FSDP processes loads on 1, 3,
or under DDP, optimizer state included, since every state is named by
parameter (fully qualified names), not by position or rank.

DCP's own reader unpickles the directory's ``.metadata`` and can be told to
``torch.load`` entries with ``weights_only=False``: reading goes through
:class:`hapi.checkpoint.dcp_reader.SafeFileSystemReader`, which refuses both.

torch reports a failure to read or write the files (a truncated shard, a full
disk, a link refused) as its ``CheckpointException``, a ``BaseException`` that
``except Exception`` misses: it becomes a
:class:`~hapi.checkpoint.CheckpointError` naming the directory and each
process's cause.

Who writes the manifest is DCP's own choice: its coordinator (the process
that also writes ``.metadata``), which :class:`_Writer` records; this module
never tests a rank. Background saves run their collectives on a process group
of their own (:func:`hapi.distributed.background_group`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hapi import distributed
from hapi.checkpoint.background import snapshot
from hapi.checkpoint.dcp_reader import NoFollowFileSystem, SafeFileSystemReader
from hapi.checkpoint.errors import CheckpointError, write_failed
from hapi.checkpoint.matching import check_state_keys


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on one process that it assumes one process; that is what one process means here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        yield


@contextlib.contextmanager
def _as_checkpoint_error(directory: str, writing: bool) -> Iterator[None]:
    """DCP's ``CheckpointException`` as a :class:`CheckpointError` naming ``directory`` and the causes."""
    try:
        yield
    except CheckpointException as error:
        if writing:  # a full disk, a permission: said in words, an OSError too
            raise write_failed(directory, error) from error
        causes = "; ".join(
            f"process {rank}: {type(cause).__name__}: {cause}"
            for rank, (cause, _) in sorted(error.failures.items())
        )
        raise CheckpointError(
            f"Could not read the shards directory {directory!r} of a sharded checkpoint "
            f"({causes}). A shard was probably cut off or changed after it was written: use an "
            "earlier checkpoint, or save this one again with model.save(path, sharded=True)."
        ) from None


def _split(values: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {k: v for k, v in values.items() if torch.is_tensor(v)}
    return tensors, {k: v for k, v in values.items() if k not in tensors}


def _named_groups(network: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's groups with parameters named, as torch's state-dict API names them."""
    names = {id(p): name for name, p in network.named_parameters()}
    return [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [names[id(p)] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, remembering whether DCP made this process its coordinator."""

    is_coordinator: bool | None = None

    def __init__(self, path: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = NoFollowFileSystem()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)


def save_shards(
    directory: str,
    network: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    then_on_main: Callable[[dict[str, Any] | None], None],
    wait: bool = True,
) -> Callable[[], None]:
    """Write the network's and optimizer's tensors to ``directory``; a collective.

    ``then_on_main(rest)`` runs on rank 0 once every process's shards are
    written, with what the manifest must keep for :func:`load_shards` (the
    optimizer's groups and its non-tensor state values; ``None`` without an
    optimizer), on the process DCP coordinates from, which wrote
    ``.metadata`` last. With ``wait=False`` the tensors are copied to CPU
    memory (DCP's ``async_save``), the rest is copied too (the moment of the
    call), and the writing goes on in a background thread.
    Returns what completes the save: called now with ``wait``, else in the
    caller's background thread (it waits for DCP's future).
    """
    payload: dict[str, Any] = {"network": _split(get_model_state_dict(network))[0]}
    optimizer_rest = None
    if optimizer is not None:
        groups, plain_values = _named_groups(network, optimizer), {}
        if optimizer.state:  # torch's API would otherwise create the state with a dry step
            by_name = get_optimizer_state_dict(network, optimizer)
            groups = by_name["param_groups"]
            tensors = {}
            for name, values in by_name["state"].items():
                tensors[name], plain_values[name] = _split(values)
            payload["optimizer"] = tensors
        optimizer_rest = {
            "param_groups": groups,
            "plain_values": plain_values,
            "has_tensors": "optimizer" in payload,
        }
    writer = _Writer(directory)
    if not wait:
        optimizer_rest = snapshot(optimizer_rest)
    with _quiet(), _as_checkpoint_error(directory, writing=True):
        if wait:
            dcp.save(payload, storage_writer=writer)
        else:
            future = dcp.async_save(
                payload, storage_writer=writer, process_group=distributed.background_group()
            )

    def complete() -> None:
        if not wait:
            with _as_checkpoint_error(directory, writing=True):
                future.result()  # every process's shards written, the metadata too
        if writer.is_coordinator is None:
            raise RuntimeError(
                "torch.distributed.checkpoint never set up its writer for this save; "
                "the manifest cannot be written. Report this with your torch version."
            )
        if writer.is_coordinator:
            then_on_main(optimizer_rest)

    return complete


def _saved(directory: str, part: str) -> dict[str, Any]:
    """The entries of ``part`` (``network``, ``optimizer``) in a sharded checkpoint's metadata,
    by name within it, read safely."""
    entries = SafeFileSystemReader(directory).read_metadata().state_dict_metadata
    return {key[len(part) + 1 :]: e for key, e in entries.items() if key.startswith(part + ".")}


def saved_shapes(directory: str) -> dict[str, torch.Size]:
    """The network entries of a sharded checkpoint and their full shapes, read safely."""
    return {key: entry.size for key, entry in _saved(directory, "network").items()}


def load_shards(directory: str, network: nn.Module, keys: set[str]) -> None:
    """The network's entries named in ``keys`` from ``directory``, resharded as the network is now."""
    template = {k: v for k, v in _split(get_model_state_dict(network))[0].items() if k in keys}
    payload = {"network": template}
    with _quiet(), _as_checkpoint_error(directory, writing=False):
        dcp.load(payload, storage_reader=SafeFileSystemReader(directory))
    set_model_state_dict(network, payload["network"], options=StateDictOptions(strict=False))


def load_optimizer_shards(
    directory: str, network: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]
) -> None:
    """The optimizer state :func:`save_shards` wrote (``saved``: the manifest's part), resharded.

    Raises:
        ValueError: the file's per-parameter state has other keys than this
            optimizer's settings create (see :func:`check_state_keys`).
    """
    state: dict[str, dict[str, Any]] = {
        name: dict(values) for name, values in saved["plain_values"].items()
    }
    keys = _saved_optimizer_keys(directory, saved) if saved["has_tensors"] else {}
    parameters = dict(network.named_parameters())
    check_state_keys(
        optimizer,
        [
            [(parameters.get(name), keys.get(name)) for name in group["params"]]
            for group in saved["param_groups"]
        ],
        saved["param_groups"],
    )
    if saved["has_tensors"]:
        template = get_optimizer_state_dict(network, optimizer)  # creates the state to read into
        tensors = {name: _split(values)[0] for name, values in template["state"].items()}
        payload = {"optimizer": tensors}
        with _quiet(), _as_checkpoint_error(directory, writing=False):
            dcp.load(payload, storage_reader=SafeFileSystemReader(directory))
        for name, values in payload["optimizer"].items():
            state.setdefault(name, {}).update(values)
    set_optimizer_state_dict(
        network, optimizer, {"state": state, "param_groups": saved["param_groups"]}
    )


def _saved_optimizer_keys(directory: str, saved: dict[str, Any]) -> dict[str, set[str]]:
    """Each parameter's state keys in the file: its tensors in the shards, the rest in the manifest."""
    keys: dict[str, set[str]] = {
        name: set(values) for name, values in saved["plain_values"].items()
    }
    for entry in _saved(directory, "optimizer"):
        name, _, key = entry.rpartition(".")
        keys.setdefault(name, set()).add(key)
    return keys
