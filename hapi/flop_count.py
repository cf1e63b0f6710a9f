"""``hapi.flops`` / ``Model.flops``: Paddle's ``paddle.flops`` on a torch network.

One forward pass on example inputs, with a forward hook on every leaf module (a module with
no children) that counts its operations the way Paddle's ``dynamic_flops`` does: a
multiply-add counts once, a convolution adds one per output element for its bias (a
``Linear`` layer does not), and layers with no count function (max pooling, most
activations, ...) count zero. ``custom_ops`` counts any other module type.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hapi.summary import (
    example_args,
    forward_once,
    leaf_modules,
    print_table,
    shapes,
)

CountFn = Callable[[nn.Module, tuple, Any], Any]


def _first_tensor(value: Any) -> torch.Tensor:
    """A layer's (first) output: Paddle counts on ``y[0]`` when a layer returns several."""
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value


def _conv(m: nn.Module, x: tuple, y: Any) -> int:
    # Per output element: in_channels / groups * kernel multiply-adds, plus one for the bias.
    kernel = math.prod(m.weight.shape[2:])
    per_output = m.in_channels // m.groups * kernel + (1 if m.bias is not None else 0)
    return _first_tensor(y).numel() * per_output


def _adaptive_avg_pool(dims: int, m: nn.Module, x: tuple, y: Any) -> int:
    """An adaptive average pooling over the last ``dims`` dimensions."""
    out = _first_tensor(y)
    kernel = math.prod(i // o for i, o in zip(x[0].shape[-dims:], out.shape[-dims:]))
    return (kernel + 1) * out.numel()  # the adds of a window, and one division


# Paddle's table (paddle/hapi/dynamic_flops.py register_hooks), in torch's names. BatchNorm
# of every rank counts as Paddle counts BatchNorm2D; torch's other dropouts count as Dropout.
_COUNTS_BY_NAME: dict[str, CountFn] = {
    "Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d ConvTranspose3d": _conv,
    # normalise and scale, in eval mode
    "BatchNorm1d BatchNorm2d BatchNorm3d": lambda m, x, y: 2 * x[0].numel(),
    "ReLU ReLU6 Dropout Dropout1d Dropout2d Dropout3d AlphaDropout": lambda m, x, y: 0,
    "LeakyReLU": lambda m, x, y: x[0].numel(),
    "Linear": lambda m, x, y: m.in_features * _first_tensor(y).numel(),
    "AvgPool1d AvgPool2d AvgPool3d": lambda m, x, y: _first_tensor(y).numel(),
    **{f"AdaptiveAvgPool{d}d": functools.partial(_adaptive_avg_pool, d) for d in (1, 2, 3)},
}
COUNTERS: dict[type, CountFn] = {
    getattr(nn, name): count for names, count in _COUNTS_BY_NAME.items() for name in names.split()
}


def _counter(module: nn.Module, counters: Mapping[type, CountFn]) -> CountFn | None:
    """The count function of the module's type or of its nearest base class that has one.

    A subclass (a user's ``Conv2d`` with weight standardisation) counts as its base.
    """
    return next((counters[cls] for cls in type(module).__mro__ if cls in counters), None)


def _counters(custom_ops: Any) -> dict[type, CountFn]:
    """:data:`COUNTERS` with ``custom_ops`` over them (a custom entry wins at the same class)."""
    if custom_ops is not None and (
        not isinstance(custom_ops, Mapping)
        or not all(
            isinstance(k, type) and issubclass(k, nn.Module) and callable(v)
            for k, v in custom_ops.items()
        )
    ):
        raise TypeError(
            "custom_ops must map module classes to functions fn(module, inputs, output) that "
            "return the module's FLOPs (or add them to module.total_ops, as Paddle's do), e.g. "
            f"{{nn.LeakyReLU: count_leaky_relu}}; received {custom_ops!r}."
        )
    custom = {cls: functools.partial(_run_custom, fn) for cls, fn in (custom_ops or {}).items()}
    return {**COUNTERS, **custom}


_UNSET = object()


def _run_custom(fn: CountFn, module: nn.Module, inputs: tuple, output: Any) -> int:
    """A user's count function, returning its count or adding it to ``module.total_ops``."""
    previous = module.__dict__.get("total_ops", _UNSET)  # a module's own attribute stays
    module.__dict__["total_ops"] = 0  # Paddle's functions do ``m.total_ops += n``
    try:
        returned = fn(module, inputs, output)
        return int(module.__dict__["total_ops"]) + (0 if returned is None else int(returned))
    finally:
        module.__dict__.pop("total_ops", None)
        if previous is not _UNSET:
            module.__dict__["total_ops"] = previous


def count_flops(
    network: nn.Module,
    input_size: Any = None,
    custom_ops: Mapping[type, CountFn] | None = None,
    print_detail: bool = False,
    input: Any = None,
    device: torch.device | None = None,
) -> int:
    """``flops`` on a given device (``Model.flops`` passes the model's)."""
    if not isinstance(network, nn.Module):
        raise TypeError(
            f"flops needs a torch.nn.Module; received {type(network).__name__}. Pass your "
            "network, e.g. hapi.flops(LeNet(), (1, 1, 28, 28)), or call model.flops(...)."
        )
    counters = _counters(custom_ops)
    if device is None:  # where the first parameter or buffer lives; the CPU for neither
        tensors = (*network.parameters(), *network.buffers())
        device = tensors[0].device if tensors else torch.device("cpu")
    args = example_args(input_size, None, input, device)
    if args is None:
        raise ValueError(
            "flops needs example inputs to run the network once: give input_size, e.g. "
            "flops(net, (1, 1, 28, 28)), or input= with the tensor(s) themselves."
        )
    records: dict[nn.Module, tuple[str, str, int]] = {}  # inputs, output, FLOPs

    def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
        count = _counter(module, counters)
        ops = records.get(module, ("", "", 0))[2] + (count(module, inputs, output) if count else 0)
        records[module] = (shapes(inputs), shapes(_first_tensor(output)), ops)

    forward_once(network, args, input_size, hook)
    rows, uncounted = [], []
    for name, module in leaf_modules(network):
        if module not in records:
            continue  # not run by this forward pass: neither FLOPs nor parameters
        params = sum(p.numel() for p in module.parameters())
        rows.append(
            (name or type(network).__name__, *records[module][:2], params, records[module][2])
        )
        kind = type(module).__name__
        if _counter(module, counters) is None and kind not in uncounted:
            uncounted.append(kind)
    if print_detail:
        print_table(("Layer Name", "Input Shape", "Output Shape", "Params", "Flops"), rows)
    if uncounted:
        print(
            f"No count function for {', '.join(uncounted)}: counted as zero FLOPs "
            "(custom_ops={Type: fn(module, inputs, output)} counts them)."
        )
    total_ops = sum(row[4] for row in rows)
    print(f"Total Flops: {total_ops}     Total Params: {sum(row[3] for row in rows)}")
    return total_ops


def flops(
    net: nn.Module,
    input_size: Any = None,
    custom_ops: Mapping[type, CountFn] | None = None,
    print_detail: bool = False,
    *,
    input: Any = None,
) -> int:
    """Count the network's FLOPs on one forward pass, as Paddle's ``paddle.flops`` does.

    Useful to compare architectures before training: the count depends only on the
    layers and the input shape. The pass runs under ``torch.no_grad()`` in eval mode on
    zeros, with no copy of the network, which is left in the mode and on the device it was.

    Args:
        net: the network (a ``torch.nn.Module``).
        input_size: the example input's shape with its batch dimension, e.g.
            ``(1, 1, 28, 28)`` (``-1``/``None`` for the batch dimension reads as 1), or any
            form ``Model.summary`` accepts (a list of shapes for several inputs, ...).
        custom_ops: ``{ModuleType: fn(module, inputs, output)}`` for types with no
            built-in count (or to replace one); ``fn`` returns the count or adds it to
            ``module.total_ops`` as Paddle's functions do.
        print_detail: also print a table of each layer's shapes, parameters and FLOPs.
        input: instead of ``input_size``, the actual input (a tensor, or a list or dict of
            them, passed to the network as its one argument).

    Returns:
        The total FLOPs (multiply-adds counted once), an int.

    Raises:
        TypeError: ``net`` is no module, or ``custom_ops``/``input_size`` are malformed.
        ValueError: no input was given, or a shape has more than one unknown dimension.
    """
    return count_flops(net, input_size, custom_ops, print_detail, input=input)
