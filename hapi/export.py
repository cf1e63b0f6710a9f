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

SUFFIX = ".pt2"

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def export_path(path: str | os.PathLike) -> str:
    """The file ``export_network`` writes: ``path`` itself if it ends in ``.pt2``, else ``path + ".pt2"``."""
    path = os.fspath(path)
    return path if path.endswith(SUFFIX) else path + SUFFIX


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
    _check_not_sharded(network)
    device = next((t.device for t in (*network.parameters(), *network.buffers())), None)
    inputs = _as_inputs(example_inputs, device)
    file = export_path(path)
    modes = {module: module.training for module in network.modules()}
    network.eval()
    try:
        _check_runs(network, inputs)
        traced, dynamic_shapes = inputs, None
        if dynamic_batch:
            traced = _batch_of_two(inputs)
            # Dim.DYNAMIC (not Dim.AUTO): if forward fixes the batch size, export fails and says
            # so, instead of silently writing a program that rejects every other batch size.
            dynamic_shapes = tuple(
                {0: torch.export.Dim.DYNAMIC} if t.dim() > 0 else None for t in traced
            )
        try:
            program = torch.export.export(network, traced, dynamic_shapes=dynamic_shapes)
        except Exception as error:
            raise RuntimeError(_explain(network, error, dynamic_batch)) from error
    finally:
        for module, training in modes.items():
            module.training = training
    with atomic_write(file) as handle:
        torch.export.save(program, handle)
        # The archive writer leaves the position at 0; atomic_write truncates at the position.
        handle.seek(0, os.SEEK_END)
    return file


def _as_inputs(example_inputs: Any, device: torch.device | None) -> tuple[torch.Tensor, ...]:
    """``example_inputs`` as the tuple of positional tensors ``torch.export`` traces with."""
    accepted = (
        "a tensor or NumPy array (one input) or a tuple/list of them (one per positional "
        "argument of forward)"
    )
    items = list(example_inputs) if isinstance(example_inputs, (tuple, list)) else [example_inputs]
    if not items:
        raise TypeError(
            f"example_inputs is an empty {type(example_inputs).__name__}; export needs "
            f"{accepted}, e.g. model.export(path, x_test[:4])."
        )
    tensors = []
    for position, item in enumerate(items):
        if isinstance(item, np.ndarray):  # torch's TypeError names a dtype it cannot hold
            item = torch.from_numpy(np.ascontiguousarray(item))
        if not torch.is_tensor(item):
            where = "example_inputs" if item is example_inputs else f"example_inputs[{position}]"
            raise TypeError(
                f"{where} is {type(item).__name__}; export needs {accepted}. Received "
                f"{describe(example_inputs)}."
            )
        tensors.append(item if device is None else item.to(device))
    return tuple(tensors)


def _check_not_sharded(network: nn.Module) -> None:
    """Refuse FSDP's sharded parameters: a forward would wait for every other process's shards."""
    sharded = distributed.sharded_parameters(network)
    if sharded:
        raise RuntimeError(
            f"{distributed.class_name(network)}'s parameters are sharded over processes (DTensors: "
            f"{', '.join(sharded[:3])}{', ...' if len(sharded) > 3 else ''}), as FSDP leaves "
            "them; its forward gathers the shards from every process, so one process cannot "
            "run or export it alone. Call model.export(...) on every process (it gathers the "
            "full weights and exports a plain copy on rank 0), or load a saved checkpoint "
            "into an unsharded network and export that."
        )


def _check_runs(network: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """Run ``forward`` eagerly once, so that a wrong example is not reported as an export failure."""
    try:
        with torch.no_grad():
            network(*inputs)
    except Exception as error:
        name = distributed.class_name(network)
        problem = (
            f"{type(error).__name__}: {_first_lines(str(error))}{_user_location(error, network)}"
        )
        if distributed.is_collective_failure(error):  # not the inputs' fault: say so
            raise RuntimeError(
                f"{name}'s forward made a collective that failed, before any export: {problem}. "
                "Export runs forward on rank 0 alone; a forward that needs the other processes "
                "cannot be exported as it is."
            ) from error
        raise RuntimeError(
            f"{name} fails on example_inputs {describe(list(inputs))} before any "
            f"export: {problem}. If example_inputs are not what forward takes, pass them as it "
            "does (one tensor per positional argument, the shapes and dtypes of a real batch); "
            "if they are, the line named is where forward itself fails."
        ) from error


def _batch_of_two(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A batch of 1 repeated to 2: the tracer would treat a dim 0 of size 1 as the constant 1.

    Only when every input's batch is 1; an input of size 1 beside larger ones
    is more likely broadcast than batched, and repeating it would change
    what ``forward`` computes.
    """
    batched = [tensor for tensor in inputs if tensor.dim() > 0]
    if not batched or any(tensor.shape[0] != 1 for tensor in batched):
        return inputs
    return tuple(torch.cat([tensor, tensor]) if tensor.dim() > 0 else tensor for tensor in inputs)


def _first_lines(message: str, limit: int = 400) -> str:
    """The first non-empty line of torch's message, with the ``- ...`` detail lines that follow it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()] or ["(no message)"]
    # torch's own hints in detail lines name its API (mark_dynamic, Dim.DYNAMIC), not export()'s: cut them.
    kept = [lines[0]] + [
        line.split(" If you're using")[0] for line in lines[1:4] if line.startswith("- ")
    ]
    text = " ".join(kept).rstrip(".")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _user_location(error: BaseException, network: nn.Module) -> str:
    """`` (at file:line in function: `code`)`` for the line of the network's code that failed, or ``""``.

    The deepest frame in a file that defines one of the network's modules, torch's
    own excepted: the line of ``forward`` to change.
    """
    own = set()
    for module in network.modules():
        filename = getattr(sys.modules.get(type(module).__module__), "__file__", None)
        if filename and not os.path.abspath(filename).startswith(_TORCH_DIR):
            own.add(os.path.abspath(filename))
    frames = traceback.extract_tb(error.__traceback__)
    frames = [frame for frame in frames if os.path.abspath(frame.filename) in own]
    if not frames:
        return ""
    frame = frames[-1]
    code = f": `{frame.line.strip()}`" if frame.line else ""
    return f" (at {frame.filename}:{frame.lineno} in {frame.name}{code})"


def _explain(network: nn.Module, error: BaseException, dynamic_batch: bool) -> str:
    """torch.export's failure in a sentence: the operation, the network's line, what to change."""
    message = str(error)
    if "data-dependent" in message or "data dependent" in message:
        advice = (
            "forward branches on, or sizes a tensor by, the values of a tensor (`if x.sum() > 0`, "
            "`.item()`, `int(tensor)`), while an exported program is one graph for every input. "
            "Write value-dependent branches with torch.cond(pred, true_fn, false_fn, (x,)) or "
            "torch.where, or move that logic out of forward."
        )
    elif dynamic_batch and ("specialized" in message or "Constraints violated" in message):
        advice = (
            "forward fixes the batch size (e.g. x.view(4, -1) or a shape check against the example's "
            "batch), so the program cannot take any batch size. Use x.shape[0] or -1 instead of a "
            "constant, or pass dynamic_batch=False to export for the example's batch size only."
        )
    else:
        advice = (
            "torch.export traces forward with symbolic tensors: it needs tensor operations, not Python "
            "that inspects tensor values, does I/O or calls libraries that do not accept tensors. Change "
            "the line above, or try torch.export.draft_export(network, example_inputs) to list every "
            "problem at once."
        )
    return (
        f"torch.export could not export {type(network).__name__}: {type(error).__name__}: "
        f"{_first_lines(message)}{_user_location(error, network)}. {advice}"
    )
