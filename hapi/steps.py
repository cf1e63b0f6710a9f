"""One batch: forward, loss, backward, accumulation, mixed precision, update.

No callbacks and no host synchronisation happen here: a step returns device
tensors and the loop decides when to read them.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from hapi import distributed
from hapi.amp import AMP_DTYPES
from hapi.batches import KeywordInputs
from hapi.data import describe

# What DistributedDataParallel says when a parameter got no gradient in the previous step.
_UNUSED_PARAMETERS = "parameters that were not used in producing loss"
# A forward's error about what it was given: shapes, dtypes, sizes, arguments.
_ABOUT_INPUTS = re.compile(
    r"(?i)shape|size|dtype|scalar type|dimension|\bdims?\b|channels|mat[12]|must match|argument|"
    r"expected (input|tensor|all tensors)|not enough values|index out of range|out of bounds|"
    r"can't convert|cannot convert|unpack"
)
# ... unless it comes from the processes' group or FSDP, whatever words it uses.
_NOT_ABOUT_INPUTS = re.compile(r"(?i)FSDP|DTensor|process group|collective|Gloo|NCCL|timed? ?out")


def check_clipping(clip_grad_norm: Any, clip_grad_value: Any) -> tuple[float | None, float | None]:
    """``prepare``'s clipping bounds: positive numbers, at most one of the two (as in Keras)."""
    bounds = {"clip_grad_norm": clip_grad_norm, "clip_grad_value": clip_grad_value}
    for name, value in bounds.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and not (number and 0 < value < math.inf):
            raise ValueError(
                f"{name} must be a positive finite number (or None); received {value!r}."
            )
    if None not in bounds.values():
        raise ValueError(
            f"prepare() got clip_grad_norm={clip_grad_norm!r} and clip_grad_value={clip_grad_value!r}; "
            "choose one: the first scales all gradients to a total L2 norm, the second clips each."
        )
    return tuple(None if value is None else float(value) for value in bounds.values())


@dataclass
class PerOutputLoss:
    """``prepare(loss=[loss_0, loss_1, ...], loss_weights=...)``: Keras' per-output losses.

    Loss i scores output i against label i; the trained loss is their sum
    weighted by ``weights``, and each part is logged as ``output_<i>_loss``.
    """

    losses: list[Callable]
    weights: list[float]

    def parts(self, outputs: list[Any], labels: list[Any]) -> list[torch.Tensor]:
        if len(outputs) != len(self.losses) or len(labels) != len(self.losses):
            raise ValueError(
                f"prepare(loss=[...]) has {len(self.losses)} losses, one per output, but a batch gave "
                f"{len(outputs)} outputs {describe(outputs)} and {len(labels)} labels {describe(labels)}. "
                "Give one output and one label per loss (Model(labels=...) counts the labels)."
            )
        return [loss(output, label) for loss, output, label in zip(self.losses, outputs, labels)]


def check_loss(loss: Any, loss_weights: Sequence[float] | None) -> Any:
    """``prepare``'s loss: a callable, or one per output (a list, with optional weights)."""
    per_output = isinstance(loss, (list, tuple))  # one loss per output (Keras)
    if loss_weights is not None and not per_output:
        raise ValueError(
            "loss_weights weighs per-output losses: pass loss=[loss_0, loss_1, ...] with it."
        )
    for index, part in enumerate(loss if per_output else [loss]):
        name = f"loss[{index}]" if per_output else "loss"
        if isinstance(part, type):
            raise TypeError(
                f"{name} is the class {part.__name__}; pass an instance, e.g. {part.__name__}()."
            )
        if (per_output or part is not None) and not callable(part):
            raise TypeError(
                f"{name} must be callable as loss(outputs, labels); received {type(part).__name__}."
            )
    if not per_output:
        return loss
    weights = [1.0] * len(loss) if loss_weights is None else [float(w) for w in loss_weights]
    if len(weights) != len(loss):
        raise ValueError(
            f"loss_weights has {len(weights)} entries for {len(loss)} losses; give one "
            "weight per output's loss."
        )
    return PerOutputLoss(list(loss), weights)


def _outputs_and_loss(result: Any) -> tuple[list[Any], torch.Tensor | None]:
    """A network's return value as (outputs, its own loss or None); see :meth:`Stepper.forward`."""
    if isinstance(result, dict):
        found = result if "logits" in result or "loss" in result else {}
    elif torch.is_tensor(result) or isinstance(result, (list, tuple)):
        found = {}
    else:
        found = {key: getattr(result, key) for key in ("logits", "loss") if hasattr(result, key)}
    if not found:
        return as_list(result), None
    logits = found.get("logits")
    return ([] if logits is None else [logits]), found.get("loss")


def as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass
class Stepper:
    """One batch's mechanics for ``model``, reading what its ``prepare`` chose (loss,
    optimizer, amp, scaler, clipping, strategy) from it where they are used."""

    model: Any
    network: nn.Module  # what training runs: DDP's or FSDP's network, or the plain one
    # Evaluation and prediction run the plain module (or its torch.compile'd
    # twin): DDP's forward would broadcast buffers, a collective that hangs
    # when shards differ in length.
    eval_network: nn.Module
    # The total gradient norm before clipping at the last update (a device
    # tensor, read only when figures are), with clip_grad_norm.
    grad_norm: torch.Tensor | None = None
    # With per-output losses, the last batch's parts by name (output_<i>_loss).
    loss_parts: dict[str, torch.Tensor] = field(default_factory=dict)
    # Set by fit for the batch in progress: whether it updates, and its share of the loss.
    accumulation: tuple[bool, float] = (True, 1.0)
    scaled_update: bool = False  # the fp16 scaler stepped since its last update

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.model._amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.model.device.type, dtype=AMP_DTYPES[self.model._amp])

    def forward(
        self, network: nn.Module, inputs: list[Any]
    ) -> tuple[list[Any], torch.Tensor | None]:
        """``network(*inputs)`` (``network(**inputs)`` for a dict batch): its outputs, and its own loss.

        An output with ``loss``/``logits`` (a dict key or an attribute, as
        Hugging Face models return) gives its ``loss`` (the one trained when
        ``prepare`` got none) and ``[logits]`` as the outputs metrics see.
        Errors say which inputs the network got.
        """
        try:
            if len(inputs) == 1 and isinstance(inputs[0], KeywordInputs):
                return _outputs_and_loss(network(**inputs[0]))
            return _outputs_and_loss(network(*inputs))
        except (RuntimeError, ValueError, IndexError, TypeError) as error:
            text, name = str(error), distributed.class_name(network)
            if _UNUSED_PARAMETERS in text:
                raise RuntimeError(
                    f"Parameters of {name} got no gradient in the last step (unused), which DDP "
                    "refuses by default. If intended, prepare with strategy=hapi.DDP("
                    f"find_unused_parameters=True), else use them. DDP: {text.splitlines()[0]}"
                ) from error
            # Advice about the inputs only when the error is about shapes, dtypes or
            # arguments (not a process group's, say).
            message = f"The network {name} failed on inputs {describe(inputs)}: {error}."
            if _ABOUT_INPUTS.search(text) and not _NOT_ABOUT_INPUTS.search(text):
                message += (
                    " Check that the data's inputs have the shape and dtype the network expects "
                    "(e.g. float32 for Linear/Conv layers); Model(inputs=, labels=) split samples."
                )
            raise type(error)(message) from error

    def loss(
        self, outputs: list[Any], network_loss: Any, labels: list[Any], training: bool
    ) -> torch.Tensor | None:
        """The batch's loss, a scalar: ``loss_fn(*outputs, *labels)`` (a list of losses is summed,
        as in Paddle), or the network's own loss when ``prepare`` got none.

        ``None`` for an evaluation batch without the labels the loss needs, or whose network
        returned no loss. A model that takes no labels (``Model(labels=0)``) has the loss
        score the outputs alone (a network returning ``(logits, loss)``, with
        ``loss=lambda logits, loss: loss``).
        """
        loss_fn = self.model._loss
        if loss_fn is None:
            if network_loss is None and training:
                raise RuntimeError(
                    f"prepare() got no loss, so the network's own is trained, but "
                    f"{distributed.class_name(self.network)} returned no 'loss'. Pass prepare("
                    "loss=...), or return a 'loss' key or attribute as Hugging Face models do."
                )
            loss = network_loss
        elif training or labels or self.model._splitter.n_labels == 0:
            loss = self._apply(loss_fn, outputs, labels)
        else:
            return None
        if isinstance(loss, (list, tuple)) and loss_fn is not None:
            loss = torch.stack([torch.as_tensor(part) for part in loss]).sum()
        if loss is not None and (not torch.is_tensor(loss) or loss.numel() != 1):
            # Named only here: the network's class name is not worked out on every batch.
            source = f"the network {distributed.class_name(self.network)}"
            if loss_fn is not None:
                source = type(loss_fn).__name__
            raise ValueError(
                f"The loss must be a scalar tensor; {source} returned {describe(as_list(loss))}. "
                "Use reduction='mean' (or 'sum')."
            )
        return None if loss is None else loss.reshape(())

    def _apply(self, loss_fn: Any, outputs: list[Any], labels: list[Any]) -> Any:
        try:
            if not isinstance(loss_fn, PerOutputLoss):
                return loss_fn(*outputs, *labels)
            parts = loss_fn.parts(outputs, labels)
            self.loss_parts = {f"output_{i}_loss": part.detach() for i, part in enumerate(parts)}
            return sum(weight * part for weight, part in zip(loss_fn.weights, parts))
        except (RuntimeError, ValueError, IndexError, TypeError) as error:
            raise type(error)(
                f"The loss {type(loss_fn).__name__} failed on outputs {describe(outputs)} and "
                f"labels {describe(labels)}: {error}. Check their shapes and dtypes (e.g. "
                "CrossEntropyLoss wants scores [N, C] and int64 class indices [N]); "
                "Model(inputs=..., labels=...) sets how batches are split."
            ) from error

    def train(
        self, inputs: list[Any], labels: list[Any], update: bool = True, loss_scale: float = 1.0
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward and backward one batch; step the optimizer when ``update``.

        ``loss_scale`` divides the loss over an accumulation group (1/k), so
        that k accumulated batches of b equal one batch of k*b. Gradients are
        all-reduced only on the step that updates.
        """
        model = self.model
        with model._strategy._no_sync(self.network, skip_gradient_sync=not update):
            with self.autocast():
                outputs, network_loss = self.forward(self.network, inputs)
                loss = self.loss(outputs, network_loss, labels, training=True)
            # Keras trains a frozen model: the loss is reported, nothing is updated
            # (fit warns once why). Checked only when the loss has no graph.
            frozen = not loss.requires_grad and self.nothing_trainable()
            if not frozen:
                self.backward(loss * loss_scale if loss_scale != 1.0 else loss)
        if update and frozen:  # a no-op without gradients, but schedulers see it was taken
            model._optimizer.step()
        elif update:
            # Called by an override (super().train_step), the step runs the plain network,
            # whose gradients DDP does not average: update averages them.
            self.update(model._optimizer, average=model._overrides("train_step"))
        return loss.detach(), [o.detach() for o in outputs]

    def nothing_trainable(self) -> bool:
        """Whether no parameter of the network (or of the optimizer) requires a gradient."""
        parameters = list(self.eval_network.parameters())
        if self.model._optimizer is not None:
            parameters += optimized_parameters(self.model._optimizer)
        return not any(p.requires_grad for p in parameters)

    def end_step(self) -> None:
        """After a training step: the fp16 scale moves once, however many optimizers it updated."""
        if self.scaled_update:
            self.model._scaler.update()
            self.scaled_update = False

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, through the gradient scaler under fp16."""
        scaler = self.model._scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def update(self, optimizer: torch.optim.Optimizer, average: bool = False) -> None:
        """One update of ``optimizer`` from the gradients in its parameters, then zero them.

        ``average``: first average the gradients over the processes (a user's
        own step runs the plain network; the built-in one has DDP do it in
        backward). Then unscale (fp16) where a hook or clipping reads them,
        run a fit's ``on_before_optimizer_step`` (on the true gradients), clip
        (as ``prepare`` asked), step.
        """
        model = self.model
        scaler, (clip_norm, clip_value) = model._scaler, model._clipping
        run = model._fit_run
        hooked = run is not None and run.callbacks.wants("on_before_optimizer_step")
        parameters = optimized_parameters(optimizer)
        if average:
            distributed.average_gradients(parameters)
        if scaler is not None and (hooked or clip_norm is not None or clip_value is not None):
            scaler.unscale_(optimizer)  # hooks and clipping see the true gradients
        if hooked:
            run.callbacks.on_before_optimizer_step(model.epoch_step)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(parameters, clip_value)
        if clip_norm is not None:
            self.grad_norm = model._strategy._clip_grad_norm(parameters, clip_norm).detach()
        if scaler is not None:
            scaler.step(optimizer)
            self.scaled_update = True
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate(
        self, inputs: list[torch.Tensor], labels: list[torch.Tensor]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The loss (see :meth:`loss`) and the outputs."""
        with self.autocast():
            outputs, network_loss = self.forward(self.eval_network, inputs)
            return self.loss(outputs, network_loss, labels, training=False), outputs

    @torch.no_grad()
    def predict(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        with self.autocast():
            return self.forward(self.eval_network, inputs)[0]


def optimized_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
