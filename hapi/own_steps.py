"""A step of the user's own: Keras 3's ``train_step``, Lightning's ``training_step``.

:class:`OwnSteps` is a part of :class:`hapi.Model` (a mixin). A subclass
overrides ``train_step`` (and ``eval_step``/``predict_step``) to write the
step itself -- a GAN's two optimizers, several losses, state carried between
batches -- while the loop, callbacks, checkpoints, resume and several
processes keep working: ``backward`` and ``optimizer_step`` do what the
built-in step does around the user's code (loss scaling, the gradient average
over processes, clipping, the ``on_before_optimizer_step`` hook).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def named_optimizers(optimizer: Any) -> dict[str, torch.optim.Optimizer]:
    """``prepare``'s optimizer(s) by name: one, a list (names "0", "1", ...) or a dict."""
    if optimizer is None:
        return {}
    if isinstance(optimizer, torch.optim.Optimizer):
        return {"0": optimizer}
    items = (
        list(optimizer.items())
        if isinstance(optimizer, dict)
        else list(enumerate(optimizer))
        if isinstance(optimizer, (list, tuple))
        else None
    )
    if not items or not all(isinstance(o, torch.optim.Optimizer) for _, o in items):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, or a list or dict of them (for a "
            f"train_step of your own); received {optimizer!r:.200}. Example: "
            "torch.optim.Adam(model.parameters(), lr=1e-3)."
        )
    return {str(name): o for name, o in items}


class OwnSteps:
    """``train_step``, ``eval_step``, ``predict_step``, ``backward``, ``optimizer_step``, ``autocast``."""

    def _overrides(self, name: str) -> bool:
        return getattr(type(self), name) is not getattr(OwnSteps, name)

    # -- a step of your own (Keras' train_step, Lightning's training_step) ------------
    def train_step(self, batch: Any) -> dict[str, Any]:
        """Override in a subclass to write the training step yourself (Keras' ``train_step``).

        For what the built-in step cannot express: a GAN's two optimizers,
        several losses, state carried between batches (truncated BPTT). Run
        ``self.network``, compute losses, call :meth:`backward` and
        :meth:`optimizer_step` for each optimizer in ``self.optimizers``, and
        return the figures to log. The loop, callbacks, checkpoints, resume and
        several processes keep working: on several processes
        :meth:`optimizer_step` averages the gradients first, so every copy of
        the model stays the same. ``prepare(metrics=...)`` are not updated
        (return figures instead); ``accumulate_grad_batches`` must stay 1.
        Carry state between batches in attributes, and define
        ``step_state_dict()``/``load_step_state_dict(state)`` so that a resume
        restores it.

        Args:
            batch: the loader's batch on the model's device, as the data gives
                it (a tuple or list, or a dict).

        Returns:
            The figures to log, e.g. ``{"loss": ..., "d_loss": ...}`` (scalar
            tensors or numbers); their running means over the epoch reach
            callbacks and :class:`callbacks.History` like the built-in loss.

        Example:
            .. code-block:: python

                class GAN(hapi.Model):
                    def train_step(self, batch):
                        x, _ = batch
                        d_loss = ...  # the discriminator's loss
                        self.backward(d_loss)
                        self.optimizer_step(self.optimizers["d"])
                        g_loss = ...  # the generator's loss
                        self.backward(g_loss)
                        self.optimizer_step(self.optimizers["g"])
                        return {"d_loss": d_loss, "g_loss": g_loss}
        """
        raise NotImplementedError  # never called unless overridden (see _parts)

    def eval_step(self, batch: Any) -> dict[str, Any]:
        """Override to evaluate a batch yourself (used by ``evaluate`` and ``fit``'s evaluations).

        Runs under ``torch.no_grad()`` with the network in eval mode, for
        figures the built-in loss and metrics cannot give.

        Args:
            batch: the loader's batch on the model's device, as the data gives it.

        Returns:
            The figures of this batch, e.g. ``{"loss": ..., "bleu": ...}``;
            their means over the whole data (across processes too) are what
            ``evaluate`` returns.
        """
        raise NotImplementedError

    def predict_step(self, batch: Any) -> Any:
        """Override to predict a batch yourself (used by ``predict``).

        Runs under ``torch.no_grad()`` with the network in eval mode, e.g. to
        decode, post-process or return several outputs.

        Args:
            batch: the loader's batch on the model's device, as the data gives it.

        Returns:
            A tensor, or a list/tuple of tensors (one per output), whose first
            dimension is the batch; ``predict`` collects them in data-set order.
        """
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` inside a :meth:`train_step` of your own.

        Use it rather than ``loss.backward()`` so that ``amp="fp16"`` scales the
        loss as the built-in step does (it is the plain call otherwise).

        Args:
            loss: a scalar tensor to back-propagate.
        """
        self._parts("train_step").stepper.backward(loss)

    def optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Update with ``optimizer`` inside a :meth:`train_step` of your own.

        Does what the built-in step does around an update: averages its
        parameters' gradients over the processes, unscales them (fp16), runs
        the callbacks' ``on_before_optimizer_step``, clips them as ``prepare``
        asked, steps and zeroes them.

        Args:
            optimizer: one of the optimizers given to ``prepare``; ``None``: the
                only (or first) one.

        Raises:
            ValueError: ``optimizer`` is not one given to ``prepare``.
        """
        chosen = optimizer if optimizer is not None else self._optimizer
        if chosen is None or all(chosen is not o for o in self._optimizers.values()):
            raise ValueError(
                f"optimizer_step() got {type(chosen).__name__}, which is not one of the "
                f"optimizers given to prepare() ({sorted(self._optimizers)}); pass one of "
                "self.optimizers."
            )
        run = self._fit_run
        before_update = None
        if run is not None and run.callbacks.wants("on_before_optimizer_step"):

            def before_update() -> None:
                run.callbacks.on_before_optimizer_step(self.epoch_step)

        self._parts("train_step").stepper.update(chosen, before_update, average=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The ``amp`` autocast context ``prepare`` chose, for the forward of your own steps.

        Returns:
            A context manager: ``with self.autocast(): out = self.network(x)``;
            a no-op without ``amp``.
        """
        return self._parts("train_step").stepper.autocast()
