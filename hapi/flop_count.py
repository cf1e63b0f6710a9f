"""``hapi.flops`` / ``Model.flops``: Paddle's ``paddle.flops`` on a torch network.

One forward pass on example inputs, with a forward hook on every leaf module (a module with
no children) that counts its operations the way Paddle's ``dynamic_flops`` does: a
multiply-add counts once, a convolution adds one per output element for its bias (a
``Linear`` layer does not), and layers with no count function (max pooling, most
activations, ...) count zero. ``custom_ops`` counts any other module type.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hapi.summary import example_args, forward_once, network_device, print_table, shapes

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


def _batch_norm(m: nn.Module, x: tuple, y: Any) -> int:
    return 2 * x[0].numel()  # normalise and scale, in eval mode


def _leaky_relu(m: nn.Module, x: tuple, y: Any) -> int:
    return x[0].numel()


def _linear(m: nn.Module, x: tuple, y: Any) -> int:
    return m.in_features * _first_tensor(y).numel()


def _avg_pool(m: nn.Module, x: tuple, y: Any) -> int:
    return _first_tensor(y).numel()


def _adaptive_avg_pool(dims: int) -> CountFn:
    """The count of an adaptive average pooling over the last ``dims`` dimensions."""

    def count(m: nn.Module, x: tuple, y: Any) -> int:
        out = _first_tensor(y)
        kernel = math.prod(i // o for i, o in zip(x[0].shape[-dims:], out.shape[-dims:]))
        return (kernel + 1) * out.numel()  # the adds of a window, and one division

    return count


def _zero(m: nn.Module, x: tuple, y: Any) -> int:
    return 0


# Paddle's table (paddle/hapi/dynamic_flops.py register_hooks), in torch's names. BatchNorm
# of every rank counts as Paddle counts BatchNorm2D; torch's other dropouts count as Dropout.
COUNTERS: dict[type, CountFn] = {
    **dict.fromkeys(
        (
            nn.Conv1d,
            nn.Conv2d,
            nn.Conv3d,
            nn.ConvTranspose1d,
            nn.ConvTranspose2d,
            nn.ConvTranspose3d,
        ),
        _conv,
    ),
    **dict.fromkeys((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), _batch_norm),
    **dict.fromkeys(
        (
            nn.ReLU,
            nn.ReLU6,
            nn.Dropout,
            nn.Dropout1d,
            nn.Dropout2d,
            nn.Dropout3d,
            nn.AlphaDropout,
        ),
        _zero,
    ),
    nn.LeakyReLU: _leaky_relu,
    nn.Linear: _linear,
    **dict.fromkeys((nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d), _avg_pool),
    nn.AdaptiveAvgPool1d: _adaptive_avg_pool(1),
    nn.AdaptiveAvgPool2d: _adaptive_avg_pool(2),
    nn.AdaptiveAvgPool3d: _adaptive_avg_pool(3),
}


def _counter(module: nn.Module, custom_ops: Mapping[type, CountFn]) -> tuple[CountFn | None, bool]:
    """``(function, is_custom)`` for the module's type or its nearest base class that has one.

    A subclass (a user's ``Conv2d`` with weight standardisation) counts as its base; an entry
    of ``custom_ops`` wins over a built-in one at the same class.
    """
    for cls in type(module).__mro__:
        if cls in custom_ops:
            return custom_ops[cls], True
        if cls in COUNTERS:
            return COUNTERS[cls], False
    return None, False


def _check_custom_ops(custom_ops: Any) -> Mapping[type, CountFn]:
    if custom_ops is None:
        return {}
    if not isinstance(custom_ops, Mapping) or not all(
        isinstance(k, type) and issubclass(k, nn.Module) and callable(v)
        for k, v in custom_ops.items()
    ):
        raise TypeError(
            "custom_ops must map module classes to functions fn(module, inputs, output) that "
            "return the module's FLOPs (or add them to module.total_ops, as Paddle's do), e.g. "
            f"{{nn.LeakyReLU: count_leaky_relu}}; received {custom_ops!r}."
        )
    return custom_ops


class _Record:
    """What one leaf module did in the example forward pass."""

    __slots__ = ("ops", "inputs", "output")

    def __init__(self) -> None:
        self.ops = 0
        self.inputs = "-"
        self.output = "-"


def _run_custom(fn: CountFn, module: nn.Module, inputs: tuple, output: Any) -> int:
    """A user's count function, returning its count or adding it to ``module.total_ops``."""
    had = "total_ops" in module.__dict__
    previous = module.__dict__.get("total_ops")
    module.__dict__["total_ops"] = 0  # Paddle's functions do ``m.total_ops += n``
    try:
        returned = fn(module, inputs, output)
        added = module.__dict__["total_ops"]
    finally:
        if had:
            module.__dict__["total_ops"] = previous
        else:
            module.__dict__.pop("total_ops", None)
    return int(added) + (int(returned) if returned is not None else 0)


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
    custom_ops = _check_custom_ops(custom_ops)
    device = network_device(network) if device is None else device
    args = example_args(input_size, None, input, device)
    if args is None:
        raise ValueError(
            "flops needs example inputs to run the network once: give input_size, e.g. "
            "flops(net, (1, 1, 28, 28)), or input= with the tensor(s) themselves."
        )
    records: dict[nn.Module, _Record] = {}
    uncounted: list[str] = []
    hooks = []

    def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
        record = records.setdefault(module, _Record())
        record.inputs, record.output = shapes(inputs), shapes(_first_tensor(output))
        fn, is_custom = _counter(module, custom_ops)
        if is_custom:
            record.ops += _run_custom(fn, module, inputs, output)
        elif fn is not None:
            record.ops += fn(module, inputs, output)

    leaves = [(n, m) for n, m in network.named_modules() if not list(m.children())]
    for _, module in leaves:
        hooks.append(module.register_forward_hook(hook))
    try:
        forward_once(network, args, input_size)
    finally:
        for handle in hooks:
            handle.remove()
    rows = []
    total_ops = total_params = 0
    for name, module in leaves:
        record = records.get(module)
        if record is None:
            continue  # not run by this forward pass: neither FLOPs nor parameters
        params = sum(p.numel() for p in module.parameters())
        total_ops += record.ops
        total_params += params
        rows.append(
            (name or type(network).__name__, record.inputs, record.output, params, record.ops)
        )
        kind = type(module).__name__
        if _counter(module, custom_ops)[0] is None and kind not in uncounted:
            uncounted.append(kind)
    if print_detail:
        print_table(("Layer Name", "Input Shape", "Output Shape", "Params", "Flops"), rows)
    if uncounted:
        print(
            f"No count function for {', '.join(uncounted)}: counted as zero FLOPs "
            "(custom_ops={Type: fn(module, inputs, output)} counts them)."
        )
    print(f"Total Flops: {total_ops}     Total Params: {total_params}")
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
