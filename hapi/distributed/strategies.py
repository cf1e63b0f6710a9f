"""How the network is spread over the processes: the ``strategy`` of ``Model.prepare``.

One class per strategy, holding the user's options, all with one interface
-- wrap the network (``FSDP`` applies torch's ``fully_shard`` there), skip
gradient sync while accumulating, clip, gather the full weights for
evaluation, state dicts in torch's plain layout for saving and loading -- so
that the steps, the Model and the checkpoint code never ask which strategy
runs. :func:`resolve_strategy` turns what ``prepare`` received (``None``,
``"auto"``, ``"ddp"``, ``"fsdp"`` or an instance) into one, with errors that
say what is accepted. On one process every strategy is a no-op: nothing is
wrapped and every method is the plain one.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn
from torch.optim import Optimizer

from hapi.distributed import ddp, fsdp
from hapi.distributed.collectives import sync_from_main
from hapi.distributed.env import DistributedSetupError
from hapi.distributed.group import rank, world_size


def _no_sync(wrapped: nn.Module, skip_gradient_sync: bool) -> contextlib.AbstractContextManager:
    """DDP skips its all-reduce, FSDP its reduce-scatter: the update step syncs what accumulated.

    FSDP's switch is set at every step rather than restored after one: every
    backward of a sharded network runs inside this (the built-in step; a step
    of the user's own is refused under FSDP).
    """
    if fsdp.is_sharded(wrapped):
        wrapped.set_requires_gradient_sync(not skip_gradient_sync)
    if skip_gradient_sync and isinstance(wrapped, nn.parallel.DistributedDataParallel):
        return wrapped.no_sync()
    return contextlib.nullcontext()


def class_name(network: nn.Module) -> str:
    """The name of the user's class of ``network``, for messages: through DDP, torch.compile
    and FSDP's class swap (``fully_shard`` turns a ``Net`` into an ``FSDPNet``)."""
    module = ddp.unwrap(getattr(network, "_orig_mod", network))
    module = ddp.unwrap(getattr(module, "_orig_mod", module))
    return fsdp.user_class(type(module)).__name__


# DistributedDataParallel's keywords hapi.DDP sets itself.
_SET_BY_HAPI = {"module", "device_ids", "output_device", "process_group"}


class Strategy:
    """The interface, with the behaviour of a network every process holds whole.

    Each method asks the network how it is spread (plain, in DDP, or sharded by
    FSDP), so FSDP before its network is sharded is the plain behaviour.
    """

    _shards_weights = False  # whether each process holds only a shard (backups are then sharded)

    # Inside: a backward keeps its gradients local (an accumulation step).
    _no_sync = staticmethod(_no_sync)
    # Inside: every process holds the full weights (evaluation, prediction).
    _gathered = staticmethod(fsdp.gathered)
    # Clip to a total L2 norm over every gradient; returns the norm before clipping.
    _clip_grad_norm = staticmethod(fsdp.clip_grad_norm)
    _load_state_dict = staticmethod(fsdp.load_full_state_dict)
    # ``optimizer.state_dict()``'s layout: full tensors, parameters numbered.
    _full_optimizer_state = staticmethod(fsdp.full_optimizer_state)
    _load_optimizer_state = staticmethod(fsdp.load_optimizer_state)

    def _check_own_step(self, model_class: str) -> None:
        """Refuse a ``train_step`` of the user's own where this strategy cannot run one."""

    def _inference_network(self, network: nn.Module) -> Callable[[], nn.Module]:
        """What rank 0 exports, as a function to call there once every process has called this.

        The network itself where each process holds it whole. Where it is
        sharded, the full weights are gathered here (a collective) and the
        function builds a plain copy, whose forward needs no other process.
        """
        state = self._full_state_dict(network)  # the network's own state_dict where not sharded
        return lambda: fsdp.plain_copy(network, state) if fsdp.is_sharded(network) else network

    def _full_state_dict(self, network: nn.Module) -> dict[str, torch.Tensor]:
        """The weights as full tensors (on rank 0 at least; a collective under FSDP)."""
        return fsdp.full_tensors(ddp.unwrap(network).state_dict(), keep=rank() == 0)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __repr__(self) -> str:
        options = {**vars(self), **vars(self).get("ddp_kwargs", {})}
        shown = ", ".join(f"{k}={v!r}" for k, v in options.items() if k != "ddp_kwargs")
        return f"hapi.{type(self).__name__}({shown})"


class DDP(Strategy):
    """``DistributedDataParallel``, torch's data parallelism: every process holds the whole model.

    The default strategy on several processes (``strategy=None``, ``"auto"`` or
    ``"ddp"``); build one to pass DDP's options:
    ``model.prepare(..., strategy=hapi.DDP(find_unused_parameters=True))``.
    Each process trains on its own shard of the batch and the gradients are
    averaged during the backward. On one process a no-op.

    Args:
        find_unused_parameters: let a forward leave some parameters unused
            (DDP then searches the graph each step, which costs time).
        static_graph: the set of used parameters never changes (lets DDP
            skip that search and support reentrant checkpointing).
        sync_batchnorm: turn the network's BatchNorm layers into
            ``SyncBatchNorm``, which normalises over every process's batch.
            torch runs SyncBatchNorm on GPU modules only.
        **ddp_kwargs: any other ``DistributedDataParallel`` keyword
            (``bucket_cap_mb``, ``gradient_as_bucket_view``, ...).

    Raises:
        TypeError: a keyword torch-hapi sets itself (``module``,
            ``device_ids``, ``output_device``, ``process_group``).
    """

    def __init__(
        self,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        sync_batchnorm: bool = False,
        **ddp_kwargs: Any,
    ) -> None:
        reserved = sorted(_SET_BY_HAPI & {*ddp_kwargs})
        if reserved:
            raise TypeError(
                f"hapi.DDP sets {', '.join(reserved)} itself (from the Model's device and the "
                "process group); leave them out of its keywords."
            )
        self.find_unused_parameters = bool(find_unused_parameters)
        self.static_graph = bool(static_graph)
        self.sync_batchnorm = bool(sync_batchnorm)
        self.ddp_kwargs = ddp_kwargs

    def _wrap_network(self, network: nn.Module, device: torch.device, *_: Any) -> nn.Module:
        """The module training runs (``network`` itself on one process). The optimizer and the
        amp dtype that follow are FSDP's concern (:meth:`FSDP._wrap_network`), not DDP's."""
        if self.sync_batchnorm and world_size() > 1:
            if device.type != "cuda":
                raise DistributedSetupError(
                    "hapi.DDP(sync_batchnorm=True): SyncBatchNorm runs only on GPU modules, but "
                    f"this Model trains on {device}; leave sync_batchnorm off on CPU processes."
                )
            if isinstance(network, nn.modules.batchnorm._BatchNorm):
                raise DistributedSetupError(
                    "hapi.DDP(sync_batchnorm=True) cannot convert a network that is a BatchNorm "
                    "layer itself; wrap it in an nn.Sequential first."
                )
            for name, child in network.named_children():  # in place: model.network stays the user's
                setattr(network, name, nn.SyncBatchNorm.convert_sync_batchnorm(child))
        options = {key: vars(self)[key] for key in ("find_unused_parameters", "static_graph")}
        return ddp.wrap(network, device, {**options, **self.ddp_kwargs})


class FSDP(Strategy):
    """Fully sharded data parallelism (torch's FSDP2): each process holds 1/N of the model.

    For a model that outgrows one device under DDP: with Adam in float32, DDP
    needs 16 bytes per parameter on every device, FSDP 16/N plus one unit's
    full weights at a time. Pass it as ``model.prepare(..., strategy=hapi.FSDP())``
    (or ``strategy="fsdp"``). torch's ``fully_shard`` is applied to each
    submodule ``wrap`` selects, children before parents, then to the network;
    every process starts from rank 0's weights and the optimizer is pointed at
    the shards. ``amp`` becomes FSDP's mixed-precision policy: parameters
    gathered in bf16/fp16 for the forward and backward, gradients reduced in
    float32, the optimizer stepping float32 shards (autocast still runs around
    the forward, as on one process). ``model.network`` stays your module, and
    ``model.save(path)`` still writes one plain file of full tensors. On one
    process a no-op, like every strategy.

    Args:
        wrap: which submodules become units sharded on their own: a set of
            module classes (e.g. ``{TransformerBlock}``) or a callable
            ``module -> bool``. ``None``: each direct child that holds
            parameters. Modules sharing a parameter (a tied embedding) stay in
            one unit.
        reshard_after_forward: free each unit's gathered weights after its
            forward and gather them again for the backward (less memory);
            ``False`` keeps them (one gather less per step).
        cpu_offload: keep the shards and the optimizer step on the CPU (pinned
            memory on CUDA), for models whose shards do not fit on the devices.

    Raises:
        TypeError: ``wrap`` is neither ``None``, a callable, nor module classes.

    Example:
        .. code-block:: python

            model.prepare(optimizer, loss, strategy=hapi.FSDP(wrap={Block}))
    """

    def __init__(
        self,
        wrap: set[type] | Callable[[nn.Module], bool] | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
    ) -> None:
        fsdp.check_wrap(wrap)
        self.wrap = wrap
        self.reshard_after_forward = bool(reshard_after_forward)
        self.cpu_offload = bool(cpu_offload)

    @property
    def _shards_weights(self) -> bool:
        return world_size() > 1

    def _gathered(self, network: nn.Module) -> contextlib.AbstractContextManager:
        return fsdp.gathered(network, self.reshard_after_forward)

    def _wrap_network(
        self, network: nn.Module, device: torch.device, optimizer: Optimizer | None, amp: Any
    ) -> nn.Module:
        """Apply ``fully_shard`` to the units and then to ``network``, in place; returns it
        (``model.network`` stays the user's).

        ``amp`` (the amp dtype, or None) becomes the mixed-precision policy:
        parameters gathered in that dtype for the forward and backward,
        gradients reduced in float32. The optimizer's groups are moved to the
        shards, and any state it holds is sharded with them.
        """
        if world_size() == 1 or fsdp.is_sharded(network):
            return network
        names = {id(p): name for name, p in network.named_parameters()}
        groups = optimizer.param_groups if optimizer is not None else []
        strangers = sum(id(p) not in names for group in groups for p in group["params"])
        if strangers:
            raise DistributedSetupError(
                f"The optimizer holds {strangers} tensor(s) that are not parameters of "
                f"{type(network).__name__}, which FSDP shards; build it over model.parameters()."
            )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        sync_from_main(network, parameters=True)  # one starting model, whatever each rank holds
        saved_optimizer = optimizer.state_dict() if optimizer is not None else None
        mesh = init_device_mesh(device.type, (world_size(),))
        options: dict[str, Any] = dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        if self.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        mixed = MixedPrecisionPolicy(amp, None if amp is None else torch.float32)
        for unit in [*fsdp.selected_units(network, self.wrap, norms=amp is not None), network]:
            policy = MixedPrecisionPolicy() if isinstance(unit, fsdp.NORM_LAYERS) else mixed
            fully_shard(unit, mp_policy=policy, **options)
        current = dict(network.named_parameters())
        for group in groups:  # moved from the replaced parameters to the shards
            group["params"] = [current[names[id(p)]] for p in group["params"]]
        if optimizer is not None:
            fsdp.load_optimizer_state(network, optimizer, saved_optimizer)  # its state, sharded
        return network

    def _check_own_step(self, model_class: str) -> None:
        if world_size() > 1:
            raise DistributedSetupError(
                f"{model_class} overrides train_step, which runs the plain network, but FSDP "
                "shards it and needs its own forward: use strategy='ddp', or FSDP's built-in step."
            )


def resolve_strategy(strategy: Any) -> DDP | FSDP:
    """The strategy ``prepare(strategy=...)`` asks for, as an object.

    Raises:
        ValueError / TypeError: not a strategy.
    """
    if isinstance(strategy, (DDP, FSDP)):
        return strategy
    if strategy is None or isinstance(strategy, str) and strategy in ("auto", "ddp", "fsdp"):
        return FSDP() if strategy == "fsdp" else DDP()
    accepted = "'auto', 'ddp' or 'fsdp' (or hapi.DDP(...) / hapi.FSDP(...))"
    if isinstance(strategy, str):
        raise ValueError(f"strategy must be {accepted}; received {strategy!r}.")
    raise TypeError(f"strategy must be None, {accepted}; received {type(strategy).__name__}.")
