"""``Model.summary``: parameter counts and, given example inputs, each layer's shapes.

Also home of what ``summary`` and ``flops`` share: reading Paddle's ``input_size`` (or
``input=``) into the arguments of one forward pass, and running that pass without changing
the network (no gradients, every module's train/eval mode and the global RNG left as found).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

_SHAPE_HELP = (
    "Give a shape such as (1, 1, 28, 28) or an int (one dimension), a list of shapes for "
    "several inputs, or nested tuples for nested inputs, e.g. [(-1, 23, 16), ((2, -1, 32), "
    "(2, -1, 32))] for an LSTM's x and (h0, c0)"
)


def _is_dim(value: Any) -> bool:
    return value is None or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def _check_shape(shape: tuple, input_size: Any) -> torch.Size:
    """One input's shape, its batch dimension (-1 or None) made 1."""
    where = f"input_size {input_size!r}"
    if not (isinstance(input_size, (tuple, list)) and tuple(input_size) == shape):
        where += f" holds the shape {shape!r}, which"
    unknown = [i for i, d in enumerate(shape) if d is None or d == -1]
    if len(unknown) > 1:
        raise ValueError(
            f"{where} has {len(unknown)} dimensions given as -1 or None; only the first "
            "(batch) dimension may be -1 or None, one per shape (for an RNN's h0/c0 the batch "
            "dimension is the second). Give every other dimension its size, e.g. (-1, 16) "
            "instead of (-1, -1)."
        )
    for d in shape:
        if d is not None and d != -1 and d <= 0:
            raise ValueError(
                f"{where} has the size {d}; every size must be greater than zero (-1 or None "
                "only for the batch dimension)."
            )
    return torch.Size(1 if i in unknown else int(d) for i, d in enumerate(shape))


def _parse(size: Any, input_size: Any) -> Any:
    """A ``torch.Size`` for a shape, else the same list/tuple of parsed items."""
    if _is_dim(size) and size is not None:
        return _check_shape((size,), input_size)  # Paddle: an int n is the shape (n,)
    if isinstance(size, (tuple, list)):
        if all(_is_dim(d) for d in size):
            return _check_shape(tuple(size), input_size)
        return type(size)(_parse(item, input_size) for item in size)
    raise TypeError(
        f"input_size {input_size!r} holds {size!r} ({type(size).__name__}), which is neither "
        f"a size nor a shape. {_SHAPE_HELP}."
    )


def _dtype(value: Any) -> torch.dtype:
    """``dtype=`` of one input: ``None`` (float32), a ``torch.dtype`` or its name."""
    if value is None or isinstance(value, torch.dtype):
        return value or torch.float32
    found = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
    if isinstance(found, torch.dtype):
        return found
    raise TypeError(
        f"dtype must be a torch.dtype or its name (e.g. torch.int64 or 'int64'), one for all "
        f"inputs or a list with one per input; received {value!r}."
    )


def _zeros(parsed: Any, dtype: Any, device: torch.device) -> Any:
    """Zeros for each shape (zeros, not random: the global RNG stays untouched)."""
    if isinstance(parsed, torch.Size):
        if isinstance(dtype, (list, tuple)):
            raise ValueError(
                f"dtype {dtype!r} is a list where the input is the single shape "
                f"{tuple(parsed)}; give one dtype for it, e.g. 'int64'."
            )
        return torch.zeros(parsed, dtype=_dtype(dtype), device=device)
    if not isinstance(dtype, (list, tuple)):
        dtype = [dtype] * len(parsed)
    if len(dtype) != len(parsed):
        raise ValueError(
            f"dtype {dtype!r} has {len(dtype)} entries for {len(parsed)} inputs; give one "
            "dtype per input, or a single dtype for all of them."
        )
    return type(parsed)(_zeros(p, d, device) for p, d in zip(parsed, dtype))


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
    parsed = _parse(input_size, input_size)
    args = [parsed] if isinstance(parsed, torch.Size) else list(parsed)
    return list(_zeros(args, dtype, device))


def leaf_modules(network: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for every module with no children: the layers a table lists."""
    return [
        (name, module) for name, module in network.named_modules() if not list(module.children())
    ]


def forward_once(
    network: nn.Module, args: list[Any], input_size: Any, hook: Callable[..., None]
) -> None:
    """Runs ``network(*args)`` in eval mode without gradients, ``hook`` on every leaf module.

    ``hook(module, inputs, output)`` is a forward hook, removed afterwards. Eval mode, as
    Paddle does: dropout stays off and BatchNorm's running statistics keep their values.
    Each module gets back its own mode (a frozen BatchNorm inside a training network stays
    in eval). A failing forward says which example inputs it was given.
    """
    modes = [(module, module.training) for module in network.modules()]
    hooks = [module.register_forward_hook(hook) for _, module in leaf_modules(network)]
    network.eval()
    try:
        with torch.no_grad():
            network(*args)
    except Exception as error:
        given = "input=" if input_size is None else f"input_size={input_size!r}"
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(
                f"(raised by the example forward pass of {type(network).__name__} on "
                f"inputs of shapes {shapes(args)} built from {given})"
            )
        raise
    finally:
        for handle in hooks:
            handle.remove()
        for module, training in modes:
            module.training = training


def shapes(value: Any) -> str:
    """Shapes of the tensors in ``value`` (nested lists, tuples and dicts)."""
    if torch.is_tensor(value):
        return str(list(value.shape))
    if isinstance(value, (list, tuple)):
        return ", ".join(shapes(v) for v in value)
    if isinstance(value, Mapping):
        return ", ".join(f"{k}: {shapes(v)}" for k, v in value.items())
    return type(value).__name__


def print_table(headers: tuple[str, ...], rows: list[tuple]) -> int:
    """Prints a ruled table; returns its width for the lines printed after it."""
    widths = [max(len(str(value)) for value in column) for column in zip(headers, *rows)]
    line = "-" * (sum(widths) + 2 * (len(headers) - 1))
    print(line)
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    print(line.replace("-", "="))
    for row in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    print(line.replace("-", "="))
    return len(line)


def summarize(
    network: nn.Module, input_size: Any, dtype: Any, device: torch.device, input: Any = None
) -> dict[str, int]:
    """Print a table of layers and return ``{"total_params", "trainable_params"}``.

    The totals count every parameter of the network once, whether or not the example
    forward pass uses it, so they are the same with and without ``input_size``.
    """
    args = example_args(input_size, dtype, input, device)
    seen: dict[nn.Module, tuple[str, str]] = {}

    def record(module: nn.Module, inputs: tuple, output: Any) -> None:
        seen[module] = (shapes(inputs), shapes(output))

    if args is not None:
        forward_once(network, args, input_size, record)
    rows = [
        (
            name or type(network).__name__,
            type(module).__name__,
            *seen.get(module, ("-", "-")),
            f"{sum(p.numel() for p in module.parameters(recurse=False)):,}",
        )
        for name, module in leaf_modules(network)
    ]
    total = sum(p.numel() for p in network.parameters())
    trainable = sum(p.numel() for p in network.parameters() if p.requires_grad)
    width = print_table(("Layer", "Type", "Input shape", "Output shape", "Params"), rows)
    print(f"Total params: {total:,}")
    print(f"Trainable params: {trainable:,}")
    print(f"Non-trainable params: {total - trainable:,}")
    print("-" * width)
    return {"total_params": total, "trainable_params": trainable}
