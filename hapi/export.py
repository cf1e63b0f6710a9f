"""The network for inference, as a ``torch.export`` program (``model.export``).

A ``.pt2`` file written here holds the traced graph and the weights; it loads
with ``torch.export.load(path).module()`` in a process that has torch only,
neither torch-hapi nor the network's Python class. That is the point of
exporting: a trained model can be served by code that knows nothing of how
it was trained.

Three things make export friendlier than calling ``torch.export`` by hand:

- the network is traced in eval mode (Dropout off, BatchNorm on its running
  statistics), which is what inference needs, and each submodule's mode is
  put back afterwards, so exporting in the middle of training is harmless;
- dim 0 of every input is declared dynamic, so the program accepts any batch
  size. An example batch of 1 would make the tracer treat that dimension as
  the constant 1 (size-1 dimensions are specialised because broadcasting
  depends on them), so a batch of 1 is traced as a batch of 2 made by
  repeating it; the program is the same, only the trace's sample differs;
- when tracing fails, the error names the network, the operation and the
  line of ``forward`` that stopped it, and the usual fix, instead of
  torch's internal trace.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import numpy as np
import torch
from torch import nn

from hapi import distributed
from hapi.checkpoint import atomic_write
from hapi.data import describe

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_ACCEPTED = (
    "export needs a tensor or NumPy array (one input) or a tuple/list of them (one per "
    "positional argument of forward)."
)


def export_path(path: str | os.PathLike) -> str:
    """The file ``export_network`` writes: ``path`` itself if it ends in ``.pt2``, else ``path + ".pt2"``."""
    path = os.fspath(path)
    return path if path.endswith(".pt2") else path + ".pt2"


def export_network(
    network: nn.Module, path: str | os.PathLike, example_inputs: Any, dynamic_batch: bool = True
) -> str:
    """Trace ``network`` with ``torch.export`` on ``example_inputs`` and save it to a ``.pt2`` file.

    Args:
        network: the module to export; it is traced in eval mode and every
            submodule's train/eval mode is restored afterwards.
        path: where to write; ``.pt2`` is appended unless ``path`` already
            ends with it (torch.export's convention). Parent directories are
            created. The file is replaced atomically: if export fails, a file
            already at ``path`` is left untouched.
        example_inputs: what ``forward`` takes, positionally: a tensor or
            NumPy array (one input) or a tuple/list of them (several inputs).
            They are moved to the network's device; their values only guide
            the trace, their shapes (apart from dim 0) and dtypes are fixed
            in the program.
        dynamic_batch: declare dim 0 of every input dynamic, so that the
            program runs on any batch size (default). ``False`` fixes every
            shape to the example's; the loaded program then refuses other
            shapes.

    Returns:
        The path of the file written.

    Raises:
        TypeError: ``example_inputs`` is not a tensor/array or a tuple/list of them.
        RuntimeError: ``network``'s parameters are sharded over processes (FSDP), or
            ``network`` fails on ``example_inputs``, or ``torch.export``
            cannot trace it; the message says which operation and line, and
            what to change. The original exception is chained.
    """
    sharded = distributed.sharded_parameters(network)
    if sharded:  # a forward would wait for every other process's shards
        raise RuntimeError(
            f"{distributed.class_name(network)}'s parameters are sharded over processes by FSDP "
            f"({', '.join(sharded[:3])}{', ...' if len(sharded) > 3 else ''}): one process cannot "
            "export it alone. Call model.export(...) on every process (rank 0 exports a copy)."
        )
    device = next((t.device for t in (*network.parameters(), *network.buffers())), None)
    inputs = _as_inputs(example_inputs, device)
    modes = {module: module.training for module in network.modules()}
    network.eval()
    exporting = False
    try:
        with torch.no_grad():  # eagerly first: a wrong example is not reported as an export failure
            network(*inputs)
        exporting = True
        # A batch of 1 is traced as a batch of 2: the tracer would make a size-1 dim 0 the
        # constant 1. Only when every input's batch is 1: an input of size 1 beside larger
        # ones is more likely broadcast than batched.
        batched = [tensor.dim() > 0 for tensor in inputs]
        if dynamic_batch and any(batched) and all(t.shape[0] == 1 for t in inputs if t.dim()):
            inputs = tuple(torch.cat([t, t]) if t.dim() else t for t in inputs)
        # Dim.DYNAMIC (not Dim.AUTO): if forward fixes the batch size, export fails and says
        # so, instead of silently writing a program that rejects every other batch size.
        # No dynamic_shapes at all for a fixed batch: a per-input tuple of Nones is checked
        # against forward's signature, which a forward(*inputs) does not match.
        dynamic = tuple({0: torch.export.Dim.DYNAMIC} if b else None for b in batched)
        program = torch.export.export(
            network, inputs, dynamic_shapes=dynamic if dynamic_batch else None
        )
    except Exception as error:
        raise RuntimeError(_explain(network, error, inputs, dynamic_batch, exporting)) from error
    finally:
        for module, training in modes.items():
            module.training = training
    file = export_path(path)
    with atomic_write(file) as handle:
        torch.export.save(program, handle)
        # The archive writer leaves the position at 0; atomic_write truncates at the position.
        handle.seek(0, os.SEEK_END)
    return file


def _as_inputs(example_inputs: Any, device: torch.device | None) -> tuple[torch.Tensor, ...]:
    """``example_inputs`` as the tuple of positional tensors ``torch.export`` traces with."""
    several = isinstance(example_inputs, (tuple, list))
    items = list(example_inputs) if several else [example_inputs]
    for position, item in enumerate(items):
        if isinstance(item, np.ndarray):  # torch's TypeError names a dtype it cannot hold
            items[position] = item = torch.from_numpy(np.ascontiguousarray(item))
        if not torch.is_tensor(item):
            where = f"example_inputs[{position}]" if several else "example_inputs"
            raise TypeError(
                f"{where} is {type(item).__name__}; {_ACCEPTED} Received {describe(example_inputs)}."
            )
    if not items:
        raise TypeError(
            f"example_inputs is an empty {type(example_inputs).__name__}; {_ACCEPTED} "
            "E.g. model.export(path, x_test[:4])."
        )
    return tuple(item.to(device) for item in items)  # to(None) keeps a tensor where it is


def _problem(error: BaseException, network: nn.Module) -> str:
    """``Type: message (at file:line in function: `code`)``: torch's first lines, then the
    deepest frame in a file that defines one of the network's modules, torch's own excepted
    (the line of ``forward`` to change)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or ["(no message)"]
    # torch's own hints in its detail lines name its API (mark_dynamic, Dim.DYNAMIC), not
    # export()'s: cut them.
    kept = [lines[0]] + [
        line.split(" If you're using")[0] for line in lines[1:4] if line.startswith("- ")
    ]
    text = " ".join(kept).rstrip(".")
    text = f"{type(error).__name__}: " + (text if len(text) <= 400 else text[:397] + "...")
    files = {
        getattr(sys.modules.get(type(m).__module__), "__file__", None) for m in network.modules()
    }
    own = {os.path.abspath(f) for f in files if f and not os.path.abspath(f).startswith(_TORCH_DIR)}
    frames = traceback.extract_tb(error.__traceback__)
    frames = [frame for frame in frames if os.path.abspath(frame.filename) in own]
    if not frames:
        return text
    frame = frames[-1]
    code = f": `{frame.line.strip()}`" if frame.line else ""
    return f"{text} (at {frame.filename}:{frame.lineno} in {frame.name}{code})"


def _explain(
    network: nn.Module, error: BaseException, inputs: Any, dynamic_batch: bool, exporting: bool
) -> str:
    """A failure in a sentence: of the eager forward on the example or of torch.export, the
    operation, the network's line, and what to change."""
    name, message = distributed.class_name(network), str(error)
    head = f"torch.export could not export {name}"
    if not exporting and distributed.is_collective_failure(error):  # not the inputs' fault
        head = f"{name}'s forward made a collective that failed, before any export"
        advice = "Export runs forward on rank 0 alone, without the other processes it needs."
    elif not exporting:
        head = f"{name} fails on example_inputs {describe(list(inputs))} before any export"
        advice = (
            "Pass example_inputs as forward takes them: one tensor per positional argument, with "
            "the shapes and dtypes of a real batch."
        )
    elif "data-dependent" in message or "data dependent" in message:
        advice = (
            "forward branches on a tensor's values (`if x.sum() > 0`, `.item()`), while a program "
            "is one graph for every input: use torch.cond or torch.where, or move that logic out."
        )
    elif dynamic_batch and ("specialized" in message or "Constraints violated" in message):
        advice = (
            "forward fixes the batch size (e.g. x.view(4, -1)): use x.shape[0] or -1 instead of "
            "the constant, or pass dynamic_batch=False to export for the example's batch size."
        )
    else:
        advice = (
            "torch.export needs tensor operations, not Python that inspects tensor values or "
            "calls other libraries: change that line (torch.export.draft_export lists them all)."
        )
    return f"{head}: {_problem(error, network)}. {advice}"
