"""Fully sharded data parallelism through torch's FSDP2 (``fully_shard``).

``fully_shard`` turns each selected submodule's parameters into DTensors
sharded over the processes (dimension 0, one piece each) and gathers them
only for that submodule's forward and backward. Everything here is torch's
own engine; what torch-hapi adds is what a Model needs around it. The
strategy :class:`hapi.FSDP` applies ``fully_shard`` (its ``_wrap_network``):
every process starts from rank 0's weights (FSDP2, unlike DDP, shards
whatever each process holds), and the user's optimizer, built over the
unsharded parameters, is pointed at the sharded ones (any state it already
holds is sharded with them). This module holds the rest:

* the units to shard (:func:`selected_units`);
* state dicts in torch's plain layout (full tensors, optimizer state keyed
  by parameter index), so a file saved under FSDP loads on one process with
  no torch-hapi distributed code;
* evaluation with the full weights on every process, so that shards of the
  evaluation data may differ in length (FSDP's per-layer gathers are
  collectives every process must join);
* modules that share a parameter (tied embeddings) kept in one unit, which
  FSDP requires;
* a plain, unsharded copy of the network for ``model.export`` (a sharded
  forward on rank 0 alone would wait forever for the others' gathers).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from hapi.distributed.ddp import unwrap
from hapi.distributed.group import rank
from hapi.messages import warn

# Normalisation layers: under amp each is a unit of its own that keeps float32 weights, as under
# autocast on one process, which runs them in float32 (and batch_norm refuses bfloat16 weights
# beside float32 running statistics).
NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


# torch's FSDP2 and DTensor are imported where they are used: together
# they cost about a second at import (DTensor brings sympy), paid by every process of every run,
# and most runs never shard. A run that never imported them holds no DTensor and no FSDP module,
# which is what the two checks below rely on.
def _is_dtensor(tensor: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _unit_class() -> tuple[type, ...]:
    """``(FSDPModule,)``, the class of the units ``fully_shard`` made, or ``()`` (which no module is
    an instance of) where FSDP was never imported: the second argument of isinstance/issubclass."""
    module = sys.modules.get("torch.distributed.fsdp")
    return () if module is None else (module.FSDPModule,)


def check_wrap(wrap: Any) -> Callable[[nn.Module], bool] | None:
    """``hapi.FSDP(wrap=...)`` as a test ``module -> bool`` (``None`` for the default).

    Raises:
        TypeError: neither ``None``, a callable, nor nn.Module classes.
    """
    if wrap is None or (callable(wrap) and not isinstance(wrap, type)):
        return wrap
    classes = tuple(wrap) if isinstance(wrap, (set, frozenset, list, tuple)) else (wrap,)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            f"hapi.FSDP(wrap=...) takes a set of nn.Module classes or a callable "
            f"module -> bool; received {wrap!r}."
        )
    return lambda module: isinstance(module, classes)


def selected_units(network: nn.Module, wrap: Any, norms: bool = False) -> list[nn.Module]:
    """The submodules sharded on their own, children before their parents (FSDP2 needs that order).

    ``wrap``: ``None`` (each direct child that holds parameters), a set of
    module classes, or a callable ``module -> bool``. With ``norms`` (under
    amp), every normalisation layer (:data:`NORM_LAYERS`) is a unit too.

    FSDP refuses a parameter managed by two units ("shared with a parameter
    already managed by another FSDP group"), so a module whose parameters are
    also used outside it (an embedding tied to the output layer) is never a
    unit of its own: its parameters stay in the nearest unit holding every
    user, the root at worst. By default that is silent (the default is only a
    guess at a good split); modules the user named are left out with a warning.
    """
    selects = check_wrap(wrap)
    if selects is None:
        chosen = [(n, m) for n, m in network.named_children() if any(True for _ in m.parameters())]
    else:
        chosen = [(n, m) for n, m in network.named_modules() if n and selects(m)]  # n: not the root
    shared = {n: names for n, m in chosen if (names := _shared_outside(network, m))}
    if shared and wrap is not None:
        listed = "; ".join(f"{n!r} shares {', '.join(names)}" for n, names in shared.items())
        warn(
            f"hapi.FSDP(wrap={wrap!r}) selected modules whose parameters are also used outside "
            f"them ({listed}): they stay in the enclosing unit; untie them to shard them alone.",
        )
    units = [m for n, m in chosen if n not in shared]
    if norms:
        units += [m for m in network.modules() if isinstance(m, NORM_LAYERS) and m is not network]
    # modules() is in pre-order, parents first: reversed, children come first.
    return [m for m in reversed(list(network.modules())) if m in units]


def _shared_outside(network: nn.Module, module: nn.Module) -> list[str]:
    """Names (in ``network``) of ``module``'s parameters that a module outside it also holds."""
    inside = {id(m) for m in module.modules()}
    own = {id(p) for p in module.parameters()}
    return sorted(  # every path to every parameter, with the module holding it at that path
        name
        for name, parameter in network.named_parameters(remove_duplicate=False)
        if id(parameter) in own and id(network.get_submodule(name.rpartition(".")[0])) not in inside
    )


def sharded_parameters(network: nn.Module) -> list[str]:
    """Names of ``network``'s parameters that are shards of FSDP's (DTensors)."""
    return [name for name, p in network.named_parameters() if _is_dtensor(p)]


def is_sharded(network: nn.Module) -> bool:
    """Whether FSDP sharded ``network`` (not on one process, nor before training)."""
    return isinstance(network, _unit_class())


def full_state_dict(network: nn.Module) -> dict[str, torch.Tensor]:
    """The network's whole ``state_dict`` on every process, as plain tensors, however it is spread.

    For code that needs the full weights whatever the strategy (a copy of the
    best weights, an average of them): a plain network's ``state_dict``, the
    user's module's inside DDP (keys without ``module.``), and under torch's
    FSDP2 (``fully_shard``), where each process holds a DTensor shard of each
    parameter, every shard gathered into the full tensor. Under FSDP this is
    a collective that every process must call, and every tensor comes back on
    the CPU: the full model is never held in device memory at once. As with
    ``state_dict``, tensors not gathered share their storage with the network
    (clone them to keep a copy that later steps cannot change).

    Args:
        network: the module, plain, wrapped in ``DistributedDataParallel`` or
            sharded by ``fully_shard``.

    Returns:
        The parameter and buffer names of the user's module, mapped to plain tensors.

    Example:
        .. code-block:: python

            best = {k: v.clone() for k, v in hapi.distributed.full_state_dict(net).items()}
    """
    return full_tensors(unwrap(network).state_dict(), keep=True)


def full_tensors(state: dict[str, Any], keep: bool) -> dict[str, Any]:
    """``state`` with each DTensor shard gathered into its full tensor (a collective), all on
    the CPU; kept only where ``keep`` (empty elsewhere). ``state`` itself where it holds no
    shard.

    A save keeps it on rank 0 alone: one full copy of a sharded model in the
    machine's memory rather than one per process.
    """
    if not any(_is_dtensor(value) for value in state.values()):
        return state
    full = {}
    for key, value in state.items():
        if _is_dtensor(value):
            value = value.full_tensor()  # a collective: every process, in the same order
        if keep:
            full[key] = value.cpu() if torch.is_tensor(value) else value
    return full


def _shard_like(full: Any, like: Any) -> Any:
    """``full`` cut as the DTensor ``like`` is (this process's slice, with no communication);
    ``full`` itself where ``like`` is no DTensor (then DTensor is not imported, see above)."""
    if not _is_dtensor(like) or _is_dtensor(full):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def load_full_state_dict(
    network: nn.Module, state: dict[str, torch.Tensor], strict: bool = True
) -> None:
    """Full tensors into ``network``, each process keeping its own shard: :func:`full_state_dict`'s inverse.

    Every process passes the same full tensors. Where the network holds a
    DTensor shard (FSDP), each process copies in its own slice of the full
    tensor, cut as the shard is, with no communication; elsewhere this is
    ``load_state_dict`` (of the user's module inside DDP).

    Args:
        network: the module, plain, wrapped in ``DistributedDataParallel`` or
            sharded by ``fully_shard``.
        state: parameter and buffer names mapped to full tensors, as
            :func:`full_state_dict` or a single-process ``state_dict`` gives them.
        strict: as ``load_state_dict``'s: every key of the network, and no other.

    Raises:
        RuntimeError: missing or unexpected keys (with ``strict``), or a
            tensor whose shape is not the parameter's (``load_state_dict``'s error).
    """
    current = unwrap(network).state_dict()
    shards = {key: _shard_like(value, current.get(key)) for key, value in state.items()}
    unwrap(network).load_state_dict(shards, strict=strict)


def plain_copy(network: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of the sharded ``network`` holding the full weights ``state``, with nothing of FSDP.

    For ``model.export`` on rank 0: a forward of the sharded network gathers
    each unit's shards from every process, so rank 0 running it alone waits
    for the others until the process group times out. The copy is made of
    the user's classes (FSDP swaps each unit's class for a subclass), with
    plain parameters from ``state`` (:func:`full_state_dict`, which every
    process must have called), the module's buffers, the user's own hooks and
    none of FSDP's; tied parameters stay tied. ``network`` is not changed.
    """
    device = next((t.device for t in [*network.parameters(), *network.buffers()]), None)
    # By id: each parameter's and each module's copy; an empty slot (None) stays empty.
    copies: dict[int, Any] = {id(None): None}
    for name, parameter in network.named_parameters(remove_duplicate=False):
        if id(parameter) not in copies:  # tied parameters stay tied
            full = state[name].to(device).detach().clone()
            copies[id(parameter)] = nn.Parameter(full, requires_grad=parameter.requires_grad)

    def copy_module(module: nn.Module) -> nn.Module:
        if id(module) in copies:  # a module used twice stays one module
            return copies[id(module)]
        cls = user_class(type(module))
        twin = copies[id(module)] = cls.__new__(cls)
        # Not torch's composable-API state (FSDP's state and registry).
        fields = {k: v for k, v in vars(module).items() if not k.startswith("__composable_api_")}
        fields["_parameters"] = {k: copies[id(p)] for k, p in module._parameters.items()}
        # detach: a buffer updated in forward under autograd (a running mean kept without
        # no_grad) is no graph leaf, which deepcopy refuses.
        fields["_buffers"] = {
            k: None if b is None else b.detach().clone() for k, b in module._buffers.items()
        }
        fields["_modules"] = {k: copy_module(m) for k, m in module._modules.items()}
        for key, value in fields.items():
            if key.endswith("_hooks") and isinstance(value, dict):
                fields[key] = value.__class__(
                    (handle, hook) for handle, hook in value.items() if not _is_fsdp_hook(hook)
                )
        twin.__dict__.update(fields)
        return twin

    return copy_module(network)


def user_class(cls: type) -> type:
    """The class FSDP subclassed for a unit (``FSDPLinear`` -> ``Linear``); others unchanged."""
    return next(c for c in cls.__mro__ if not issubclass(c, _unit_class()))


def _is_fsdp_hook(hook: Any) -> bool:
    module = getattr(getattr(hook, "func", hook), "__module__", None) or ""  # through partial
    return module.startswith("torch.distributed.fsdp")


def full_optimizer_state(network: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state in torch's plain layout (full tensors, parameters numbered), on rank 0.

    ``optimizer.state_dict()``, whose numbering is already torch's; under FSDP
    each state tensor that is a shard is gathered (a collective) and kept, on
    the CPU, on rank 0 alone.
    """
    state = optimizer.state_dict()  # each entry itself where it holds no shard
    state["state"] = {i: full_tensors(v, keep=rank() == 0) for i, v in state["state"].items()}
    return state


def load_optimizer_state(
    network: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """A plain-layout optimizer state (full tensors, on every process) into the optimizer,
    sharded as the network is: each process keeps its own slice of every full tensor shaped
    like its parameter, with no communication."""
    optimizer.load_state_dict(state)
    for parameter, values in optimizer.state.items():
        for key, value in values.items():
            if torch.is_tensor(value) and value.shape == parameter.shape:
                values[key] = _shard_like(value, parameter)


@contextlib.contextmanager
def gathered(network: nn.Module, reshard_after_forward: bool = True) -> Iterator[None]:
    """Every process holds the full weights inside: forwards there make no collective.

    Evaluation shards may differ by a batch between processes; with the
    weights gathered once, each runs its own batches. Resharded on the way
    out, each unit then back to ``reshard_after_forward`` (the strategy's).
    """
    units = [m for m in network.modules() if isinstance(m, _unit_class())]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard_after_forward, recurse=False)


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_``; over DTensor shards it is the norm of the whole gradient."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if _is_dtensor(norm) else norm


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes this process holds of ``tensors`` (its shards, for DTensors)."""
    local = [t.to_local() if _is_dtensor(t) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in local)
