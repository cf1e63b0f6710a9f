"""Fully sharded data parallelism through torch's FSDP2 (``fully_shard``).

``fully_shard`` turns each selected submodule's parameters into DTensors
sharded over the processes (dimension 0, one piece each) and gathers them
only for that submodule's forward and backward. Everything here is torch's
own engine; what this module adds is what a Model needs around it:

* every process starts from rank 0's weights (FSDP2, unlike DDP, shards
  whatever each process holds);
* the user's optimizer, built over the unsharded parameters, is pointed at
  the sharded ones (and any state it already holds is sharded with them);
* state dicts in torch's plain layout (full tensors, optimizer state keyed
  by parameter index), so a file saved under FSDP loads on one process with
  no torch-hapi distributed code;
* evaluation with the full weights on every process, so that shards of the
  evaluation data may differ in length (FSDP's per-layer gathers are
  collectives every process must join).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from hapi.distributed.collectives import sync_from_main
from hapi.distributed.env import DistributedSetupError
from hapi.distributed.group import world_size

_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def check_wrap(wrap: Any) -> tuple[type, ...] | None:
    """``hapi.FSDP(wrap=...)``'s module classes (``None`` for a callable or the default).

    Raises:
        TypeError: neither ``None``, a callable, nor nn.Module classes.
    """
    if wrap is None or (callable(wrap) and not isinstance(wrap, type)):
        return None
    classes = tuple(wrap) if isinstance(wrap, (set, frozenset, list, tuple)) else (wrap,)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            f"hapi.FSDP(wrap=...) takes a set of nn.Module classes or a callable "
            f"module -> bool; received {wrap!r}."
        )
    return classes


def selected_units(network: nn.Module, wrap: Any) -> list[nn.Module]:
    """The submodules sharded on their own, children before their parents (FSDP2 needs that order).

    ``wrap``: ``None`` (each direct child that holds parameters), a set of
    module classes, or a callable ``module -> bool``.
    """
    classes = check_wrap(wrap)
    if wrap is None:
        chosen = [child for child in network.children() if any(True for _ in child.parameters())]
    elif classes is None:
        chosen = [m for m in network.modules() if m is not network and wrap(m)]
    else:
        chosen = [m for m in network.modules() if m is not network and isinstance(m, classes)]
    return _children_first(network, chosen)


def _children_first(network: nn.Module, modules: list[nn.Module]) -> list[nn.Module]:
    order = {id(m): i for i, m in enumerate(network.modules())}  # pre-order: parents first
    return sorted(modules, key=lambda m: -order[id(m)])


def shard(
    network: nn.Module,
    device: torch.device,
    optimizer: torch.optim.Optimizer | None,
    *,
    wrap: Any,
    reshard_after_forward: bool,
    cpu_offload: bool,
    amp_dtype: torch.dtype | None,
) -> nn.Module:
    """Apply ``fully_shard`` to ``network`` in place; returns it (``model.network`` stays the user's).

    ``amp_dtype`` becomes the mixed-precision policy: parameters gathered in
    that dtype for the forward and backward, gradients reduced in float32.
    """
    if world_size() == 1:
        return network
    if is_sharded(network):
        return network
    names = {id(p): name for name, p in network.named_parameters()}
    strangers = [
        p
        for group in (optimizer.param_groups if optimizer else [])
        for p in group["params"]
        if id(p) not in names
    ]
    if strangers:
        raise DistributedSetupError(
            f"The optimizer holds {len(strangers)} tensor(s) that are not parameters of "
            f"{type(network).__name__}; under FSDP every optimized tensor must belong to the "
            "network, whose parameters are replaced by their shards. Build the optimizer over "
            "model.parameters()."
        )
    sync_from_main(network, parameters=True)  # one starting model, whatever each rank initialised
    saved_optimizer = optimizer.state_dict() if optimizer is not None and optimizer.state else None
    mesh = init_device_mesh(device.type, (world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
        if amp_dtype is not None
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    options = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": policy,
        "offload_policy": offload,
    }
    units = selected_units(network, wrap)
    if amp_dtype is not None:
        # Normalisation layers keep float32 weights, as under autocast on one process,
        # which runs them in float32 (and batch_norm refuses bfloat16 weights beside
        # float32 running statistics).
        norms = [
            m
            for m in network.modules()
            if isinstance(m, _NORMS) and m is not network and m not in units
        ]
        units = _children_first(network, units + norms)
    for unit in [*units, network]:
        keep_float32 = amp_dtype is not None and isinstance(unit, _NORMS)
        fully_shard(
            unit, **{**options, "mp_policy": MixedPrecisionPolicy()} if keep_float32 else options
        )
        unit._hapi_reshard_after_forward = reshard_after_forward  # restored after gathered()
    if optimizer is not None:
        _point_at_shards(network, optimizer, names)
        if saved_optimizer is not None:
            load_optimizer_state(network, optimizer, saved_optimizer)
    return network


def _point_at_shards(
    network: nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> None:
    """The optimizer's parameter groups, moved from the replaced parameters to the sharded ones."""
    current = dict(network.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [current[names[id(p)]] for p in group["params"]]
    optimizer.state.clear()


def is_sharded(network: nn.Module) -> bool:
    """Whether :func:`shard` sharded ``network`` (not on one process, nor before training)."""
    return isinstance(network, FSDPModule)


def full_state_dict(network: nn.Module) -> dict[str, torch.Tensor]:
    """The network's weights as full plain CPU tensors on rank 0 (empty elsewhere); a collective."""
    return get_model_state_dict(network, options=_FULL)


def load_state_dict(network: nn.Module, state: dict[str, torch.Tensor], strict: bool) -> None:
    """Full tensors (on every process) into the network, sharded as it is."""
    set_model_state_dict(
        network, state, options=StateDictOptions(full_state_dict=True, strict=strict)
    )


def _parameter_names(network: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Each optimized parameter's name, in the order torch numbers them in a state dict."""
    names = {id(p): name for name, p in network.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(network: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state in torch's plain layout (full tensors, parameters numbered), on rank 0."""
    if not optimizer.state:
        return optimizer.state_dict()  # no state yet: only the groups, the same on every process
    by_name = get_optimizer_state_dict(network, optimizer, options=_FULL)
    numbers = {name: index for index, name in enumerate(_parameter_names(network, optimizer))}
    return {
        "state": {numbers[name]: value for name, value in by_name.get("state", {}).items()},
        "param_groups": [
            {**group, "params": [numbers[name] for name in group["params"]]}
            for group in by_name.get("param_groups", [])
        ],
    }


def load_optimizer_state(
    network: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """A plain-layout optimizer state (full tensors, on every process) into a sharded optimizer."""
    names = _parameter_names(network, optimizer)
    saved_count = sum(len(group["params"]) for group in state["param_groups"])
    if saved_count != len(names) or len(state["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"it holds {saved_count} parameters in {len(state['param_groups'])} group(s), "
            f"the optimizer {len(names)} in {len(optimizer.param_groups)}"
        )
    by_name = {
        "state": {names[int(index)]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[int(i)] for i in group["params"]]}
            for group in state["param_groups"]
        ],
    }
    set_optimizer_state_dict(
        network, optimizer, by_name, options=StateDictOptions(full_state_dict=True)
    )


@contextlib.contextmanager
def gathered(network: nn.Module) -> Iterator[None]:
    """Every process holds the full weights inside: forwards there make no collective.

    Evaluation shards may differ by a batch between processes; with the
    weights gathered once, each runs its own batches. Resharded on the way out.
    """
    units = [m for m in network.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(_reshard_setting(unit), recurse=False)


def _reshard_setting(unit: FSDPModule) -> bool:
    return bool(getattr(unit, "_hapi_reshard_after_forward", True))


@contextlib.contextmanager
def no_sync(network: nn.Module, skip_gradient_sync: bool) -> Iterator[None]:
    """Accumulation steps keep their full gradients locally; the update step reduce-scatters them."""
    if not skip_gradient_sync:
        yield
        return
    network.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        network.set_requires_gradient_sync(True)


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_``; over DTensor shards it is the norm of the whole gradient."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes this process holds of ``tensors`` (its shards, for DTensors)."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total
