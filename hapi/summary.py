"""``Model.summary``: parameter counts and, given an input size, each layer's output shape."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _shapes(value: Any) -> str:
    if torch.is_tensor(value):
        return str(list(value.shape))
    if isinstance(value, (list, tuple)):
        return ", ".join(_shapes(v) for v in value)
    return type(value).__name__


def _example_inputs(
    input_size: Any, dtype: torch.dtype | None, device: torch.device
) -> list[torch.Tensor]:
    """Zeros of each requested shape; a batch dimension of None or -1 becomes 1."""
    sizes = input_size if isinstance(input_size, list) else [input_size]
    inputs = []
    for size in sizes:
        if not isinstance(size, (tuple, list)) or not all(
            isinstance(d, int) or d is None for d in size
        ):
            raise TypeError(
                f"input_size must be a shape such as (1, 1, 28, 28) (batch dimension first; None "
                f"or -1 allowed for it) or a list of shapes, one per input; received {input_size!r}."
            )
        shape = [1 if (d is None or d < 0) and i == 0 else d for i, d in enumerate(size)]
        inputs.append(torch.zeros(shape, dtype=dtype or torch.float32, device=device))
    return inputs


def summarize(
    network: nn.Module, input_size: Any, dtype: torch.dtype | None, device: torch.device
) -> dict[str, int]:
    """Print a table of layers and return ``{"total_params", "trainable_params"}``."""
    rows: list[tuple[str, str, str, int]] = []
    hooks = []
    leaves = [
        (name, module) for name, module in network.named_modules() if not list(module.children())
    ]
    output_shapes: dict[str, str] = {}
    if input_size is not None:
        for name, module in leaves:
            hooks.append(
                module.register_forward_hook(
                    lambda _m, _i, out, name=name: output_shapes.__setitem__(name, _shapes(out))
                )
            )
        was_training = network.training
        try:
            network.eval()
            with torch.no_grad():
                network(*_example_inputs(input_size, dtype, device))
        finally:
            network.train(was_training)
            for hook in hooks:
                hook.remove()
    for name, module in leaves:
        count = sum(p.numel() for p in module.parameters(recurse=False))
        rows.append(
            (
                name or type(network).__name__,
                type(module).__name__,
                output_shapes.get(name, "-"),
                count,
            )
        )
    total = sum(p.numel() for p in network.parameters())
    trainable = sum(p.numel() for p in network.parameters() if p.requires_grad)
    headers = ("Layer", "Type", "Output shape", "Params")
    widths = [
        max(len(headers[i]), *(len(str(row[i])) for row in rows)) if rows else len(headers[i])
        for i in range(4)
    ]
    line = "-" * (sum(widths) + 6)
    print(line)
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print(line.replace("-", "="))
    for row in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)))
    print(line.replace("-", "="))
    print(f"Total params: {total:,}")
    print(f"Trainable params: {trainable:,}")
    print(f"Non-trainable params: {total - trainable:,}")
    print(line)
    return {"total_params": total, "trainable_params": trainable}
