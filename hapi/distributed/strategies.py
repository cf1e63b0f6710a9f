"""How the network is spread over the processes: the ``strategy`` of ``Model.prepare``.

One small class per strategy, holding the user's options; :func:`resolve`
turns what ``prepare`` received (``None``, ``"auto"``, ``"ddp"``, ``"fsdp"``
or an instance) into one, with errors that say what is accepted. On one
process every strategy is a no-op: :func:`hapi.distributed.ddp.wrap`
returns the network itself.

FSDP (``torch.distributed.fsdp.fully_shard``) is not built yet: asking for
it on several processes raises, rather than silently training under DDP
with every process holding the whole model.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from hapi.distributed.env import DistributedSetupError
from hapi.distributed.group import world_size


class DDP:
    """``DistributedDataParallel``, torch's data parallelism: every process holds the whole model.

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
    """

    name = "ddp"

    def __init__(self, find_unused_parameters: bool = False, static_graph: bool = False,
                 sync_batchnorm: bool = False, **ddp_kwargs: Any) -> None:
        reserved = sorted({"module", "device_ids", "output_device", "process_group"} & set(ddp_kwargs))
        if reserved:
            raise TypeError(f"hapi.DDP sets {', '.join(reserved)} itself (from the Model's device and "
                            f"the process group); received {reserved}. Leave them out.")
        self.find_unused_parameters = bool(find_unused_parameters)
        self.static_graph = bool(static_graph)
        self.sync_batchnorm = bool(sync_batchnorm)
        self.ddp_kwargs = ddp_kwargs

    def prepare_network(self, network: nn.Module, device: torch.device) -> None:
        """Changes made to the user's module itself before wrapping (SyncBatchNorm)."""
        if not self.sync_batchnorm:
            return
        if device.type != "cuda":
            raise DistributedSetupError(
                f"hapi.DDP(sync_batchnorm=True) converts BatchNorm layers to torch's SyncBatchNorm, "
                f"which runs only on GPU modules, but this Model trains on {device}. On CPU "
                "processes leave sync_batchnorm off (each process then normalises its own batch, "
                "and evaluation uses rank 0's statistics), or use a larger batch per process."
            )
        if isinstance(network, nn.modules.batchnorm._BatchNorm):
            raise DistributedSetupError(
                "hapi.DDP(sync_batchnorm=True) converts the BatchNorm layers inside the network, but "
                "the network itself is a BatchNorm layer; wrap it in an nn.Sequential first.")
        for name, child in network.named_children():  # in place: model.network stays the user's
            setattr(network, name, nn.SyncBatchNorm.convert_sync_batchnorm(child))

    def ddp_options(self) -> dict[str, Any]:
        return {"find_unused_parameters": self.find_unused_parameters,
                "static_graph": self.static_graph, **self.ddp_kwargs}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DDP) and vars(self) == vars(other)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in {**vars(self), **self.ddp_kwargs}.items()
                            if k != "ddp_kwargs")
        return f"hapi.DDP({options})"


class FSDP:
    """Fully sharded data parallelism (torch's FSDP2): each process holds 1/N of the model.

    Args (SPEC): ``wrap`` (module classes, or a callable ``module -> bool``,
    selecting the submodules sharded on their own; default: each direct child
    that holds parameters), ``reshard_after_forward``, ``cpu_offload``.

    Not built yet: on several processes :func:`resolve` raises. On one process
    it is a no-op, like every strategy.
    """

    name = "fsdp"

    def __init__(self, wrap: set[type] | Callable[[nn.Module], bool] | None = None,
                 reshard_after_forward: bool = True, cpu_offload: bool = False) -> None:
        self.wrap = wrap
        self.reshard_after_forward = bool(reshard_after_forward)
        self.cpu_offload = bool(cpu_offload)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FSDP) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return (f"hapi.FSDP(wrap={self.wrap!r}, reshard_after_forward={self.reshard_after_forward}, "
                f"cpu_offload={self.cpu_offload})")


def resolve(strategy: Any) -> DDP | FSDP:
    """The strategy ``prepare(strategy=...)`` asks for, as an object.

    Raises:
        ValueError / TypeError: not a strategy.
        DistributedSetupError: FSDP on several processes (not built yet).
    """
    if strategy is None or (isinstance(strategy, str) and strategy in ("auto", "ddp")):
        chosen: DDP | FSDP = DDP()
    elif isinstance(strategy, str) and strategy == "fsdp":
        chosen = FSDP()
    elif isinstance(strategy, (DDP, FSDP)):
        chosen = strategy
    elif isinstance(strategy, str):
        raise ValueError(f"strategy must be 'auto', 'ddp' or 'fsdp' (or hapi.DDP(...) / hapi.FSDP(...)); "
                         f"received {strategy!r}.")
    else:
        raise TypeError(f"strategy must be None, 'auto', 'ddp', 'fsdp', hapi.DDP(...) or hapi.FSDP(...); "
                        f"received {type(strategy).__name__}.")
    if isinstance(chosen, FSDP) and world_size() > 1:
        raise DistributedSetupError(
            f"strategy {chosen!r} asks for fully sharded training, which this version of torch-hapi "
            f"does not provide yet; on {world_size()} processes it would otherwise train with every "
            "process holding the whole model. Use strategy='ddp' (the default) for now."
        )
    return chosen
