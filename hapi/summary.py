"""``Model.summary`` and ``hapi.flops`` (Paddle's ``paddle.summary`` and ``paddle.flops``).

Both read Paddle's ``input_size`` (or ``input=``) into the arguments of one forward pass and
run that pass without changing the network: no gradients, every module's train/eval mode and
the global RNG left as found. ``summary`` prints each leaf module's shapes and parameters;
``flops`` counts each leaf module's operations the way Paddle's ``dynamic_flops`` does: a
multiply-add counts once, a convolution adds one per output element for its bias (a
``Linear`` layer does not), and layers with no count function (max pooling, most
activations, ...) count zero. ``custom_ops`` counts any other module type.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

CountFn = Callable[[nn.Module, tuple, Any], Any]

_SHAPE_HELP = (
    "Give a shape such as (1, 1, 28, 28) or an int (one dimension), a list of shapes for "
    "several inputs, or nested tuples for nested inputs, e.g. [(-1, 23, 16), ((2, -1, 32), "
    "(2, -1, 32))] for an LSTM's x and (h0, c0)"
)


def _is_dim(value: Any) -> bool:
    return value is None or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def _zeros(size: Any, dtype: Any, input_size: Any, device: torch.device) -> Any:
    """Zeros for a shape (not random: the global RNG stays untouched), else the same
    list/tuple of what its items give, with one dtype each or one for all."""
    size = (size,) if _is_dim(size) and size is not None else size  # Paddle: n is the shape (n,)
    if not isinstance(size, (tuple, list)):
        raise TypeError(
            f"input_size {input_size!r} holds {size!r} ({type(size).__name__}), which is "
            f"neither a size nor a shape. {_SHAPE_HELP}."
        )
    several = isinstance(dtype, (list, tuple))
    nested = not all(_is_dim(d) for d in size)  # several inputs, or one nested input
    inputs = len(size) if nested else 1  # Paddle takes a list's one dtype for one input
    if several and len(dtype) != inputs:
        raise ValueError(
            f"dtype {dtype!r} is a list of {len(dtype)} entries for {inputs} inputs (in {size!r}); "
            "give one dtype per input, or a single dtype for all of them."
        )
    if nested:
        dtypes = dtype if several else [dtype] * len(size)
        return type(size)(_zeros(s, d, input_size, device) for s, d in zip(size, dtypes))
    shape = tuple(size)  # one input's shape, its batch dimension (-1 or None) made 1
    where = f"input_size {input_size!r}"
    if not (isinstance(input_size, (tuple, list)) and tuple(input_size) == shape):
        where += f" holds the shape {shape!r}, which"
    unknown = [d for d in shape if d is None or d == -1]
    if len(unknown) > 1:
        raise ValueError(
            f"{where} has {len(unknown)} dimensions given as -1 or None; only the first "
            "(batch) dimension may be -1 or None (an RNN's h0/c0: the second). Give every other "
            "dimension its size, e.g. (-1, 16) instead of (-1, -1)."
        )
    for d in shape:
        if d is not None and d != -1 and d <= 0:
            raise ValueError(
                f"{where} has the size {d}; every size must be greater than zero (-1 or "
                "None only for the batch dimension)."
            )
    dtype = dtype[0] if several else dtype
    name = "float32" if dtype is None else str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise TypeError(
            f"dtype must be a torch.dtype or its name (e.g. torch.int64 or 'int64'), one for "
            f"all inputs or a list with one per input; received {dtype!r}."
        )
    shape = [1 if d is None or d == -1 else int(d) for d in shape]
    return torch.zeros(shape, dtype=getattr(torch, name), device=device)


def example_args(input_size: Any, dtype: Any, input: Any, device: torch.device) -> list[Any] | None:
    """The positional arguments of one forward pass, or ``None`` when nothing was given.

    Paddle's reading of ``input_size``: an int ``n`` is the shape ``(n,)``; a tuple or list
    of sizes is one input's shape; a list of shapes gives one positional input each, and a
    nested tuple one nested input (an LSTM's ``(h0, c0)``). ``input=`` (a tensor, a list or a
    dict of them) is passed to the network as its one argument, as Paddle does.
    """
    if input is not None:
        if input_size is not None or dtype is not None:
            raise ValueError(
                "Give either input_size (with dtype) or input, not both: input= is passed to "
                "the network as it is, so its tensors already have their shapes and dtypes."
            )
        return [input]
    if input_size is None:
        return None
    if isinstance(input_size, (list, tuple)) and len(input_size) == 0:
        raise ValueError(f"input_size is empty ({input_size!r}). {_SHAPE_HELP}.")
    args = _zeros(input_size, dtype, input_size, device)
    return [args] if torch.is_tensor(args) else list(args)


def _leaf_modules(network: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for every module with no children: the layers a table lists."""
    return [(name, m) for name, m in network.named_modules() if not list(m.children())]


def _forward_once(
    network: nn.Module, args: list[Any], input_size: Any, counters: dict | None = None
) -> dict[nn.Module, tuple[str, str, int]]:
    """Runs ``network(*args)`` in eval mode without gradients, and says for each leaf module it
    ran: its input shapes, its output shapes and its FLOPs (``counters[module]``'s count).

    With ``counters`` (flops) the output is a layer's first (Paddle counts on ``y[0]``) and a layer
    run twice counts twice. Eval mode, as Paddle does: dropout stays off and BatchNorm's
    running statistics keep their values. Each module gets back its own mode (a frozen
    BatchNorm inside a training network stays in eval). A failing forward says which example
    inputs it was given.
    """
    records: dict[nn.Module, tuple[str, str, int]] = {}

    def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
        count = None if counters is None else counters[module]
        ops = records.get(module, ("", "", 0))[2] + (count(module, inputs, output) if count else 0)
        output = output if counters is None else _first_tensor(output)
        records[module] = (_shapes(inputs), _shapes(output), ops)

    modes = [(module, module.training) for module in network.modules()]
    hooks = [module.register_forward_hook(hook) for _, module in _leaf_modules(network)]
    network.eval()
    try:
        with torch.no_grad():
            network(*args)
    except Exception as error:
        given = "input=" if input_size is None else f"input_size={input_size!r}"
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(
                f"(raised by the example forward pass of {type(network).__name__} on "
                f"inputs of shapes {_shapes(args)} built from {given})"
            )
        raise
    finally:
        for handle in hooks:
            handle.remove()
        for module, training in modes:
            module.training = training
    return records


def _shapes(value: Any) -> str:
    """Shapes of the tensors in ``value`` (nested lists, tuples and dicts)."""
    if torch.is_tensor(value):
        return str(list(value.shape))
    if isinstance(value, (list, tuple)):
        return ", ".join(_shapes(v) for v in value)
    if isinstance(value, Mapping):
        return ", ".join(f"{k}: {_shapes(v)}" for k, v in value.items())
    return type(value).__name__


def _numel(tensors: Any) -> int:
    return sum(t.numel() for t in tensors)


def _print_table(headers: tuple[str, ...], rows: list[tuple]) -> int:
    """Prints a ruled table; returns its width for the lines printed after it."""
    widths = [max(len(str(value)) for value in column) for column in zip(headers, *rows)]
    width = sum(widths) + 2 * (len(headers) - 1)
    head, *lines = [
        "  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in (headers, *rows)
    ]
    print("\n".join(["-" * width, head, "=" * width, *lines, "=" * width]))
    return width


def summarize(
    network: nn.Module, input_size: Any, dtype: Any, device: torch.device, input: Any = None
) -> dict[str, int]:
    """Print a table of layers and return ``{"total_params", "trainable_params"}``.

    The totals count every parameter of the network once, whether or not the example
    forward pass uses it, so they are the same with and without ``input_size``.
    """
    args = example_args(input_size, dtype, input, device)
    seen = {} if args is None else _forward_once(network, args, input_size)
    rows = [
        (
            name or type(network).__name__,
            type(module).__name__,
            *seen.get(module, ("-", "-"))[:2],
            f"{_numel(module.parameters(recurse=False)):,}",
        )
        for name, module in _leaf_modules(network)
    ]
    total = _numel(network.parameters())
    trainable = _numel(p for p in network.parameters() if p.requires_grad)
    width = _print_table(("Layer", "Type", "Input shape", "Output shape", "Params"), rows)
    print(f"Total params: {total:,}")
    print(f"Trainable params: {trainable:,}")
    print(f"Non-trainable params: {total - trainable:,}")
    print("-" * width)
    return {"total_params": total, "trainable_params": trainable}


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


def _run_custom(fn: CountFn, module: nn.Module, inputs: tuple, output: Any) -> int:
    """A user's count function, returning its count or adding it to ``module.total_ops``
    (Paddle's functions do ``m.total_ops += n``); a module's own ``total_ops`` stays, and so
    does anything else the function sets on the module."""
    own = {key: value for key, value in vars(module).items() if key == "total_ops"}
    vars(module)["total_ops"] = 0
    try:
        return int(fn(module, inputs, output) or 0) + int(vars(module)["total_ops"])
    finally:
        vars(module).pop("total_ops", None)
        vars(module).update(own)


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
    custom_ops = {} if custom_ops is None else custom_ops
    if not isinstance(custom_ops, Mapping) or not all(
        isinstance(k, type) and issubclass(k, nn.Module) and callable(v)
        for k, v in custom_ops.items()
    ):
        raise TypeError(
            "custom_ops must map module classes to functions fn(module, inputs, output) returning "
            f"their FLOPs, e.g. {{nn.LeakyReLU: count_leaky_relu}}; received {custom_ops!r}."
        )
    # A custom entry wins at the same class; a subclass (a user's Conv2d with weight
    # standardisation) counts as its nearest base class that has a count function.
    counters = {**COUNTERS, **{k: functools.partial(_run_custom, v) for k, v in custom_ops.items()}}
    counter_of = {
        m: next((counters[c] for c in type(m).__mro__ if c in counters), None)
        for m in network.modules()
    }
    tensors = (*network.parameters(), *network.buffers())
    # Model.flops passes its device; else where the first parameter or buffer lives, or the CPU.
    device = device or next((t.device for t in tensors), torch.device("cpu"))
    args = example_args(input_size, None, input, device)
    if args is None:
        raise ValueError(
            "flops needs example inputs to run the network once: give input_size, e.g. "
            "flops(net, (1, 1, 28, 28)), or input= with the tensor(s) themselves."
        )
    records = _forward_once(network, args, input_size, counter_of)
    # A module this forward pass did not run counts neither FLOPs nor parameters.
    ran = [(name, m) for name, m in _leaf_modules(network) if m in records]
    rows = [
        (name or type(network).__name__, *records[m][:2], _numel(m.parameters()), records[m][2])
        for name, m in ran
    ]
    uncounted = dict.fromkeys(type(m).__name__ for _, m in ran if counter_of[m] is None)
    if print_detail:
        _print_table(("Layer Name", "Input Shape", "Output Shape", "Params", "Flops"), rows)
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
