"""``hapi.Model``: the public API. Checks arguments, builds loaders and callbacks, calls the loops.

The loop bodies live in :mod:`hapi.loops`, one batch in :mod:`hapi.steps`,
processes and devices in :mod:`hapi.distributed`, files in
:mod:`hapi.checkpoint`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from callbacks import (EMA, BackupAndRestore, Callback, CallbackList, History, ModelCheckpoint,
                       ProgBarLogger)
from hapi import checkpoint, distributed
from hapi.data import BatchSplitter, batch_length, check_positive_int, make_loader, num_batches
from hapi.loops import Parts, evaluate_loop, fit_loop, predict_loop
from hapi.metrics import MetricSet, normalise_metrics
from hapi.steps import AMP_DTYPES, PerOutputLoss, Stepper, check_amp, check_clipping, make_scaler
from hapi.summary import summarize

DEFAULT_BATCH_SIZE = 32  # Keras' default; Paddle's is 1, which is rarely what anyone wants.
DEFAULT_LOG_FREQ = 10  # Paddle's default.


def _count(value: Any, name: str) -> int | None:
    """``inputs=``/``labels=``: a count, or a sequence (names, specs) whose length counts."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, Sequence)) or isinstance(value, str):
        raise TypeError(
            f"{name} must be the number of {name} per sample (an int) or a list of them "
            f"(names or specs, one per {name[:-1]}); received {value!r}."
        )
    count = value if isinstance(value, int) else len(value)
    if count < (1 if name == "inputs" else 0):
        raise ValueError(f"{name} must count at least {1 if name == 'inputs' else 0}; received {value!r}.")
    return count


def _named_optimizers(optimizer: Any) -> dict[str, torch.optim.Optimizer]:
    """``prepare``'s optimizer(s) by name: one, a list (names "0", "1", ...) or a dict."""
    if optimizer is None:
        return {}
    if isinstance(optimizer, torch.optim.Optimizer):
        return {"0": optimizer}
    items = (list(optimizer.items()) if isinstance(optimizer, dict)
             else list(enumerate(optimizer)) if isinstance(optimizer, (list, tuple)) else None)
    if not items or not all(isinstance(o, torch.optim.Optimizer) for _, o in items):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, or a list or dict of them (for a "
                        f"train_step of your own); received {optimizer!r:.200}. Example: "
                        "torch.optim.Adam(model.parameters(), lr=1e-3).")
    return {str(name): o for name, o in items}


def _names(value: Any) -> list[str] | None:
    """``labels=["labels"]``: the keys of a dict batch that hold labels."""
    if isinstance(value, Sequence) and not isinstance(value, str) and value and all(
            isinstance(item, str) for item in value):
        return list(value)
    return None


def _check_verbose(verbose: Any) -> None:
    if verbose not in (0, 1, 2):
        raise ValueError(f"verbose must be 0 (silent), 1 (progress bar) or 2 (one line per "
                         f"log_freq steps); received {verbose!r}.")


def _as_batch(values: Any, name: str) -> list[torch.Tensor]:
    """``train_batch``'s inputs/labels: a tensor/array or a list of them."""
    import numpy as np

    items = [] if values is None else (list(values) if isinstance(values, (list, tuple)) else [values])
    tensors = []
    for item in items:
        if isinstance(item, np.ndarray):
            item = torch.from_numpy(item)
        if not torch.is_tensor(item):
            raise TypeError(f"{name} must be tensors or NumPy arrays (or a list of them); "
                            f"received {type(item).__name__}.")
        tensors.append(item)
    return tensors


class _ResumeFrom(Callback):
    """``fit(resume_from=path)``: the fit continues from that file, at the start of training."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = path

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.model.load(self.path, resume=True)


def _callback_order(callback: Callback) -> int:
    """Where a callback must run among the others (a stable sort keeps the user's order otherwise).

    EMA first: its average is in place before others save or restore at the
    end. A resumable ModelCheckpoint after the rest, so that its files hold
    their state after the batch or epoch saved. A resume restores the state
    other callbacks reset in ``on_train_begin``, so ``resume_from`` and then
    BackupAndRestore come last (a backup of this very run, if any, is further
    on than ``resume_from``'s file).
    """
    if isinstance(callback, BackupAndRestore):
        return 4
    if isinstance(callback, _ResumeFrom):
        return 3
    if isinstance(callback, ModelCheckpoint) and callback.resumable:
        return 2
    return 0 if isinstance(callback, EMA) else 1


@dataclass
class _FitRun:
    """The parts of a running fit that a backup saves and a resume restores."""

    callbacks: CallbackList
    train_loader: Any
    data_seed: int


class Model:
    """Wraps an ``nn.Module`` with prepare/fit/evaluate/predict.

    Args:
        network: the user's module. ``model.network`` always returns it,
            never a distributed wrapper.
        inputs: how many leading elements of each sample feed the network
            (an int, or a list of names/specs whose length counts). Default:
            every element but the last.
        labels: how many elements after the inputs go to the loss. Default:
            the last element.
        device: where to train. ``None`` picks ``cuda:LOCAL_RANK`` when CUDA
            is available, else the CPU.
    """

    def __init__(self, network: nn.Module, inputs: Any = None, labels: Any = None,
                 device: str | torch.device | None = None) -> None:
        if not isinstance(network, nn.Module):
            raise TypeError(f"Model needs a torch.nn.Module; received {type(network).__name__}. "
                            "Pass your network instance, e.g. Model(LeNet()).")
        distributed.setup(device)
        self.device = distributed.default_device(device)
        self._network = network.to(self.device)
        self._wrapped: nn.Module | None = None
        self._splitter = BatchSplitter(self.device, _count(inputs, "inputs"), _count(labels, "labels"),
                                       label_keys=_names(labels))
        self._optimizer: torch.optim.Optimizer | None = None
        self._optimizers: dict[str, torch.optim.Optimizer] = {}  # by name ("0", "1", ... for a list)
        self._given_optimizers: Any = None
        self._loss: Any = None
        self._metrics: MetricSet | None = None
        self._amp: str | None = None
        self._compile = False
        self._clipping: tuple[float | None, float | None] = (None, None)
        self._strategy = distributed.resolve_strategy(None)
        self._scaler: torch.amp.GradScaler | None = None
        self._stepper: Stepper | None = None
        # State loaded before prepare() gave the objects it belongs to.
        self._pending_optimizer: tuple[dict, str | None] | None = None  # (state, optimizer class)
        self._pending_scaler_state: dict | None = None
        self.stop_training = False
        self.epoch = 0  # epochs completed in the current fit (restored by load)
        self.epoch_step = 0  # batches done in the epoch in progress (restored by load)
        self.step = 0  # optimizer steps taken, over the model's life (restored by load)
        self._fit_run: _FitRun | None = None  # what a resume needs, while fit() runs

    # -- public attributes ------------------------------------------------
    @property
    def network(self) -> nn.Module:
        return self._network

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer given to ``prepare`` (with several, the first)."""
        return self._optimizer

    @property
    def optimizers(self) -> Any:
        """The optimizer(s) as given to ``prepare``: one, a list or a dict (for ``train_step``)."""
        return self._given_optimizers

    def parameters(self) -> list[nn.Parameter]:
        """The network's parameters (for building the optimizer)."""
        return list(self._network.parameters())

    # -- preparation --------------------------------------------------------
    def prepare(self, optimizer: torch.optim.Optimizer | Sequence | dict | None = None, loss: Any = None,
                metrics: Any = None, amp: str | None = None, compile: bool = False,
                strategy: Any = None, clip_grad_norm: float | None = None,
                clip_grad_value: float | None = None, loss_weights: Sequence[float] | None = None) -> None:
        """Set what training and evaluation use.

        Args:
            optimizer: a ``torch.optim.Optimizer`` over ``model.parameters()``;
                or a list or dict of them for a ``train_step`` of your own
                (a GAN's two), all saved in checkpoints.
            loss: a callable ``loss(*outputs, *labels)`` returning a scalar,
                e.g. ``torch.nn.CrossEntropyLoss()``.
            metrics: a ``torchmetrics.Metric``, a list of them, or a dict
                name -> metric (see :func:`hapi.metrics.normalise_metrics`).
            amp: ``None``, ``"bf16"`` (autocast to bfloat16) or ``"fp16"``
                (float16 autocast with a gradient scaler).
            compile: run the network through ``torch.compile`` (the first
                steps pay the compilation); ``model.network`` stays your module
                and checkpoints hold its plain state dict.
            strategy: how several processes share the work: ``None``/``"auto"``
                or ``"ddp"`` (DistributedDataParallel), ``hapi.DDP(...)`` with
                DDP's options (``find_unused_parameters``, ``static_graph``,
                ``sync_batchnorm``, ...), or ``"fsdp"``/``hapi.FSDP(...)`` (torch's
                FSDP2: each process holds 1/N of the weights, gradients and
                optimizer state). A no-op on one process.
            clip_grad_norm: clip the gradients to this total L2 norm before
                every optimizer step (over every process's shards under FSDP);
                training logs then carry ``grad_norm``, the norm before clipping.
            clip_grad_value: clip each gradient element to ``[-v, v]`` instead.
            loss_weights: with ``loss=[loss_0, loss_1, ...]`` (one loss per
                network output, each scoring output i against label i, as in
                Keras), the weight of each in the trained sum; every part is
                logged as ``output_<i>_loss``. ``metrics=[[...], [...]]`` gives
                metrics per output likewise (logged as ``output_<i>_<name>``).
        """
        chosen_strategy = distributed.resolve_strategy(strategy)
        clip_norm, clip_value = check_clipping(clip_grad_norm, clip_grad_value)
        wrapped_for_several = self._wrapped is not None and distributed.world_size() > 1
        if wrapped_for_several and chosen_strategy != self._strategy:
            raise RuntimeError(
                f"prepare(strategy={chosen_strategy!r}) after this Model trained with "
                f"{self._strategy!r}: the network is already wrapped for that strategy. Build a new "
                "Model(network) to train with another strategy.")
        named_optimizers = _named_optimizers(optimizer)
        if isinstance(loss, (list, tuple)):  # one loss per output (Keras)
            for index, part in enumerate(loss):
                if isinstance(part, type) or not callable(part):
                    raise TypeError(f"loss[{index}] must be a loss instance, callable as loss(output, label); "
                                    f"received {part!r}.")
            loss = PerOutputLoss(list(loss), None if loss_weights is None else list(loss_weights))
        elif loss_weights is not None:
            raise ValueError("loss_weights weighs per-output losses: pass loss=[loss_0, loss_1, ...] with it.")
        if isinstance(loss, type):
            raise TypeError(f"loss is the class {loss.__name__}; pass an instance, e.g. "
                            f"{loss.__name__}().")
        if loss is not None and not callable(loss):
            raise TypeError(f"loss must be callable as loss(outputs, labels); received "
                            f"{type(loss).__name__}.")
        named_metrics = normalise_metrics(metrics)
        self._strategy = chosen_strategy
        self._amp = check_amp(amp)
        self._compile = bool(compile)
        self._clipping = (clip_norm, clip_value)
        self._given_optimizers = optimizer
        self._optimizers = named_optimizers
        self._optimizer = next(iter(named_optimizers.values()), None)
        self._loss = loss.to(self.device) if isinstance(loss, nn.Module) else loss
        self._metrics = MetricSet(named_metrics, with_loss=loss is not None).to(self.device)
        self._splitter.labels_to_network = loss is None  # dict batches: the network computes its loss
        self._scaler = make_scaler(self._amp, self.device)
        self._stepper = None
        if self._pending_optimizer is not None and len(named_optimizers) == 1:
            self._load_optimizer_state(*self._pending_optimizer, source="the loaded checkpoint",
                                       keep_hyperparameters=True)
            self._pending_optimizer = None
        if self._pending_scaler_state is not None and self._scaler is not None:
            self._scaler.load_state_dict(self._pending_scaler_state)
            self._pending_scaler_state = None

    def _parts(self, purpose: str) -> Parts:
        if self._metrics is None:
            raise RuntimeError(
                f"{purpose}() needs a prepared model: call model.prepare(optimizer=..., "
                f"loss=..., metrics=...) before model.{purpose}()."
            )
        if purpose in ("fit", "train_batch") and self._optimizer is None:
            raise RuntimeError(f"{purpose}() needs an optimizer: call model.prepare(optimizer="
                               "torch.optim.Adam(model.parameters()), loss=...) first.")
        own_step = self._overrides("train_step")
        if purpose in ("fit", "train_batch") and len(self._optimizers) > 1 and not own_step:
            raise RuntimeError(
                f"prepare() got {len(self._optimizers)} optimizers ({sorted(self._optimizers)}), but "
                "the built-in training step updates one. Override train_step(self, batch) in a "
                "subclass of Model to use several (a GAN's generator and discriminator), or pass one.")
        if purpose in ("fit", "train_batch") and self._wrapped is None:
            if own_step:
                # The user's step runs the plain network; Stepper.update averages the
                # gradients. Every process starts from rank 0's weights.
                self._strategy.check_own_step(type(self).__name__)
                distributed.sync_from_main(self._network, parameters=True)
                self._wrapped = self._network
            else:
                # DDP (and the gradient average it reserves) only once training needs it:
                # evaluate/predict-only runs never build it.
                self._wrapped = self._strategy.wrap_network(self._network, self.device, self._optimizer,
                                                            AMP_DTYPES.get(self._amp))
            self._stepper = None
        if self._stepper is None:
            train_network = self._network if self._wrapped is None else self._wrapped
            eval_network = self._network
            if self._compile:
                train_network, eval_network = torch.compile(train_network), torch.compile(eval_network)
            self._stepper = Stepper(train_network, self.device, self._loss, self._optimizer,
                                    self._amp, self._scaler, eval_network, self._strategy,
                                    *self._clipping)
        steps = {name: getattr(self, name) for name in ("train_step", "eval_step", "predict_step")
                 if self._overrides(name)}
        return Parts(self._stepper, self._metrics, self._splitter, **steps)

    def _overrides(self, name: str) -> bool:
        return getattr(type(self), name) is not getattr(Model, name)

    # -- a step of your own (Keras' train_step, Lightning's training_step) ------------
    def train_step(self, batch: Any) -> dict[str, Any]:
        """Override in a subclass to write the training step yourself.

        ``batch`` is the loader's batch on the model's device, as the data
        gives it (a tuple, or a dict). Run ``self.network``, compute losses,
        call :meth:`backward` and :meth:`optimizer_step` for each optimizer
        in ``self.optimizers`` (a GAN's two, say), and return the figures to
        log, e.g. ``{"loss": ..., "d_loss": ...}`` (scalars; running means
        over the epoch reach callbacks and History like the built-in loss).
        The loop, callbacks, checkpoints, resume and several processes keep
        working: on several processes :meth:`optimizer_step` averages the
        gradients first, so every copy of the model stays the same.
        ``prepare(metrics=...)`` are not updated (return figures instead);
        ``accumulate_grad_batches`` must stay 1.
        """
        raise NotImplementedError  # never called unless overridden (see _parts)

    def eval_step(self, batch: Any) -> dict[str, Any]:
        """Override to evaluate a batch yourself; return figures, averaged over the data as in training."""
        raise NotImplementedError

    def predict_step(self, batch: Any) -> Any:
        """Override to predict a batch yourself; return a tensor or a list/tuple of them (one per output)."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` inside a ``train_step`` of your own (scaled under ``amp="fp16"``)."""
        self._parts("train_step").stepper.backward(loss)

    def optimizer_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Update with ``optimizer`` (default: the only one) inside a ``train_step`` of your own.

        Averages its parameters' gradients over the processes, unscales them
        (fp16), runs ``on_before_optimizer_step``, clips them as ``prepare``
        asked, steps and zeroes them.
        """
        chosen = optimizer if optimizer is not None else self._optimizer
        if chosen is None or all(chosen is not o for o in self._optimizers.values()):
            raise ValueError(f"optimizer_step() got {type(chosen).__name__}, which is not one of the "
                             f"optimizers given to prepare() ({sorted(self._optimizers)}); pass one of "
                             "self.optimizers.")
        run = self._fit_run
        before_update = None
        if run is not None and run.callbacks.wants("on_before_optimizer_step"):
            def before_update() -> None:
                run.callbacks.on_before_optimizer_step(self.epoch_step)
        self._parts("train_step").stepper.update(chosen, before_update, average=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The ``amp`` autocast context ``prepare`` chose (a no-op without amp), for your own steps."""
        return self._parts("train_step").stepper.autocast()

    def _prediction_parts(self) -> Parts:
        if self._metrics is not None:
            return self._parts("predict")
        return Parts(Stepper(self._network, self.device, strategy=self._strategy), MetricSet({}, False),
                     self._splitter)

    def _same_model_everywhere(self) -> None:
        """Before evaluating or predicting: every process scores rank 0's model (see
        :func:`hapi.distributed.sync_from_main`); weights too if DDP never aligned them."""
        distributed.sync_from_main(self._network, parameters=self._wrapped is None)

    def _callback_list(self, callbacks: Any, *, verbose: int, log_freq: int,
                       save_dir: str | None = None, save_freq: int = 1,
                       resume_from: str | os.PathLike | None = None) -> CallbackList:
        if callbacks is None:
            user: list = []
        elif isinstance(callbacks, Callback):
            user = [callbacks]
        elif isinstance(callbacks, (list, tuple)):
            user = list(callbacks)
        else:
            raise TypeError(f"callbacks must be a Callback or a list of them; received "
                            f"{type(callbacks).__name__}.")
        # verbose=0 adds no progress bar at all: no per-batch call for a silent display.
        chosen = [] if verbose == 0 or any(isinstance(c, ProgBarLogger) for c in user) else [
            ProgBarLogger(log_freq=log_freq, verbose=verbose)]
        chosen += user
        if save_dir is not None and not any(isinstance(c, ModelCheckpoint) for c in user):
            chosen.append(ModelCheckpoint(save_dir, save_freq=save_freq))
        if not any(isinstance(c, History) for c in user):
            chosen.append(History())
        if resume_from is not None:
            chosen.append(_ResumeFrom(resume_from))
        chosen.sort(key=_callback_order)
        cbks = CallbackList(chosen)
        cbks.set_model(self)
        return cbks

    def _params(self, **values: Any) -> dict[str, Any]:
        return {"rank": distributed.rank(), "world_size": distributed.world_size(),
                "metrics": self._metrics.names() if self._metrics else [], **values}

    # -- fit / evaluate / predict -----------------------------------------------
    def fit(self, train_data: Any, eval_data: Any = None, batch_size: int = DEFAULT_BATCH_SIZE,
            epochs: int = 1, eval_freq: int = 1, log_freq: int = DEFAULT_LOG_FREQ,
            save_dir: str | None = None, save_freq: int = 1, verbose: int = 2,
            drop_last: bool = False, shuffle: bool = True, num_workers: int = 0,
            callbacks: Callback | list[Callback] | None = None, accumulate_grad_batches: int = 1,
            num_iters: int | None = None, eval_steps: int | None = None,
            resume_from: str | os.PathLike | None = None) -> History:
        """Train; returns the :class:`callbacks.History` of per-epoch figures.

        ``batch_size`` is per process. ``eval_data`` is evaluated when
        ``epoch % eval_freq == 0`` (0-based, as in Paddle). ``save_dir`` adds
        a ``ModelCheckpoint(save_dir, save_freq)``. ``num_iters`` is the
        number of training batches in total: ``epochs`` becomes
        ceil(num_iters / batches per epoch), as in Paddle, and the last
        epoch stops early when needed.
        ``accumulate_grad_batches`` averages gradients over that many batches
        before each optimizer step.

        ``eval_steps=N`` also evaluates ``eval_data`` every N optimizer steps
        (Hugging Face's ``eval_steps``, Lightning's integer
        ``val_check_interval``), besides the per-epoch evaluation; its figures
        reach callbacks through ``on_eval_end`` and :class:`callbacks.History`
        keeps every evaluation at its step (``history.evaluations``).
        ``resume_from`` continues the fit saved in a resumable checkpoint
        (``BackupAndRestore``'s backup, ``ModelCheckpoint(resumable=True)``):
        the same final weights as if it had never stopped.
        """
        parts = self._parts("fit")
        for name, value in (("epochs", epochs), ("eval_freq", eval_freq), ("log_freq", log_freq),
                            ("save_freq", save_freq), ("accumulate_grad_batches", accumulate_grad_batches)):
            check_positive_int(value, name)
        check_positive_int(num_iters, "num_iters", allow_none=True)
        check_positive_int(eval_steps, "eval_steps", allow_none=True)
        _check_verbose(verbose)
        if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
            raise TypeError(f"resume_from must be the path of a checkpoint saved during fit; received "
                            f"{type(resume_from).__name__}.")
        if accumulate_grad_batches != 1 and parts.train_step is not None:
            raise ValueError(f"fit(accumulate_grad_batches={accumulate_grad_batches}) with a train_step of "
                             f"your own ({type(self).__name__}): your step decides when to update; "
                             "accumulate in it, or leave accumulate_grad_batches=1.")
        data_seed = distributed.shared_seed()
        train_loader = make_loader(train_data, role="train_data", batch_size=batch_size,
                                   shuffle=shuffle, drop_last=drop_last, num_workers=num_workers,
                                   seed=data_seed, device=self.device)
        eval_loader = None if eval_data is None else make_loader(
            eval_data, role="eval_data", batch_size=batch_size, num_workers=num_workers,
            device=self.device)
        steps = num_batches(train_loader)
        if num_iters is not None and steps:
            epochs = math.ceil(num_iters / steps)
        cbks = self._callback_list(callbacks, verbose=verbose, log_freq=log_freq,
                                   save_dir=save_dir, save_freq=save_freq, resume_from=resume_from)
        cbks.set_params(self._params(epochs=epochs, steps=steps if num_iters is None else min(steps or num_iters, num_iters),
                                     batch_size=distributed.loader_batch_size(train_loader) or batch_size,
                                     verbose=verbose, log_freq=log_freq, eval_steps=eval_steps,
                                     accumulate_grad_batches=accumulate_grad_batches, num_iters=num_iters))
        self.stop_training = False
        self.epoch = self.epoch_step = 0
        self._fit_run = _FitRun(cbks, train_loader, data_seed)
        try:
            fit_loop(self, parts, train_loader, eval_loader, cbks, epochs=epochs, eval_freq=eval_freq,
                     log_freq=log_freq, accumulate_grad_batches=accumulate_grad_batches,
                     num_iters=num_iters, eval_steps=eval_steps)
        except BaseException:
            distributed.note_failure()  # the others may wait in a collective: don't wait for them at exit
            raise
        finally:
            self._fit_run = None
        return next(c for c in cbks if isinstance(c, History))

    def evaluate(self, eval_data: Any, batch_size: int = DEFAULT_BATCH_SIZE,
                 log_freq: int = DEFAULT_LOG_FREQ, verbose: int = 2, num_workers: int = 0,
                 callbacks: Callback | list[Callback] | None = None,
                 num_iters: int | None = None) -> dict[str, float]:
        """Figures over the whole of ``eval_data``: ``{"loss": float, <metric>: float}``."""
        parts = self._parts("evaluate")
        check_positive_int(log_freq, "log_freq")
        check_positive_int(num_iters, "num_iters", allow_none=True)
        _check_verbose(verbose)
        loader = make_loader(eval_data, role="eval_data", batch_size=batch_size,
                             num_workers=num_workers, device=self.device)
        cbks = self._callback_list(callbacks, verbose=verbose, log_freq=log_freq)
        cbks.set_params(self._params(epochs=None, steps=num_batches(loader),
                                     batch_size=distributed.loader_batch_size(loader) or batch_size,
                                     verbose=verbose, log_freq=log_freq))
        self._same_model_everywhere()
        results = evaluate_loop(parts, loader, cbks, log_freq=log_freq, num_iters=num_iters)
        if not parts.metrics.names():  # known only now: a network may compute its own loss
            raise RuntimeError("evaluate() had nothing to compute: call model.prepare(loss=..., "
                               "metrics=...) with a loss or at least one metric (or return a 'loss' "
                               "from the network).")
        return results

    def predict(self, test_data: Any, batch_size: int = DEFAULT_BATCH_SIZE, num_workers: int = 0,
                stack_outputs: bool = False, verbose: int = 1,
                callbacks: Callback | list[Callback] | None = None) -> list:
        """The network's outputs over ``test_data``, in data-set order, on the CPU.

        Returns one entry per network output: a list of per-batch tensors, or
        one tensor with the batches concatenated when ``stack_outputs``.
        Samples are split as in training and only the inputs are used, so a
        data set with labels predicts as is.
        """
        parts = self._prediction_parts()
        _check_verbose(verbose)
        loader = make_loader(test_data, role="test_data", batch_size=batch_size,
                             num_workers=num_workers, device=self.device)
        cbks = self._callback_list(callbacks, verbose=verbose, log_freq=DEFAULT_LOG_FREQ)
        cbks.set_params(self._params(epochs=None, steps=num_batches(loader),
                                     batch_size=distributed.loader_batch_size(loader) or batch_size,
                                     verbose=verbose, log_freq=DEFAULT_LOG_FREQ))
        self._same_model_everywhere()
        outputs = predict_loop(parts, loader, cbks)
        if stack_outputs:
            return [torch.cat(batches) if batches and torch.is_tensor(batches[0]) else batches
                    for batches in outputs]
        return outputs

    # -- one batch, Paddle style --------------------------------------------------
    def train_batch(self, inputs: Any, labels: Any = None, update: bool = True) -> dict[str, float]:
        """One training step; returns this batch's ``{"loss": ..., <metric>: ...}``.

        With ``update=False`` gradients accumulate until a later call updates.
        """
        parts = self._parts("train_batch")
        parts.stepper.network.train()
        inputs_, labels_ = self._to_device(inputs, labels)
        loss, outputs = parts.stepper.train(inputs_, labels_, update=update)
        self.step += int(update)
        return self._batch_figures(parts, loss, outputs, labels_)

    def eval_batch(self, inputs: Any, labels: Any = None) -> dict[str, float]:
        """Evaluate one batch; returns its ``{"loss": ..., <metric>: ...}``."""
        parts = self._parts("eval_batch")
        parts.stepper.network.eval()
        inputs_, labels_ = self._to_device(inputs, labels)
        loss, outputs = parts.stepper.evaluate(inputs_, labels_)
        return self._batch_figures(parts, loss, outputs, labels_)

    def predict_batch(self, inputs: Any) -> list[torch.Tensor]:
        """The network's outputs for one batch of inputs, as CPU tensors."""
        parts = self._prediction_parts()
        parts.stepper.network.eval()
        inputs_, _ = self._to_device(inputs, None)
        return [o.cpu() for o in parts.stepper.predict(inputs_)]

    def _to_device(self, inputs: Any, labels: Any) -> tuple[list, list]:
        return ([t.to(self.device) for t in _as_batch(inputs, "inputs")],
                [t.to(self.device) for t in _as_batch(labels, "labels")])

    @staticmethod
    def _batch_figures(parts: Parts, loss: torch.Tensor | None, outputs: list, labels: list) -> dict[str, float]:
        """Figures of this batch alone (Paddle keeps running ones; one batch is clearer)."""
        if not labels:
            return {} if loss is None else {"loss": loss.item()}
        parts.metrics.reset()
        parts.metrics.update(loss, outputs, labels, batch_length(outputs, labels))
        return parts.metrics.compute(sync=False)  # this process's batch: no collective

    # -- files --------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """Whether each process holds only a shard of the weights (FSDP on several processes).

        ``BackupAndRestore`` then backs up with ``save(..., sharded=True)``.
        """
        return self._strategy.shards_weights

    def save(self, path: str | os.PathLike, training: bool = True, resumable: bool = False,
             sharded: bool = False, wait: bool = True) -> str:
        """Write a checkpoint to ``path`` (+ ``.pt``) atomically; returns the file.

        With ``training=True`` the file holds the network, optimizer, gradient
        scaler, epoch/step counters and RNG states; with ``training=False``
        only the network's weights. ``resumable=True``, during ``fit``, adds
        what ``load(..., resume=True)`` needs to continue that fit exactly
        (each process's RNG states and running figures, the data order, every
        callback's state); ``BackupAndRestore`` saves this way. Every process
        must call it; only the main process writes.

        ``sharded=True`` writes a directory ``path`` through torch's
        distributed checkpoint (DCP) instead: every process writes the
        shards it holds (in parallel; the directory must be one that every
        process sees, as on a shared file system), and :meth:`load` reads it
        on any number of processes, under any strategy. Returns the directory.

        ``wait=False`` returns as soon as the state is copied to CPU memory
        (every process still calls it); the file is written in the background,
        replacing the previous one only once complete. The next save or load,
        :meth:`wait_for_saves` and the end of the script wait for it.
        ``BackupAndRestore`` saves this way. Meant for a file rewritten
        often: the file it replaces is kept as a hidden spare
        (``.<name>.pt.spare``) and the next background save overwrites it.
        """
        distributed.sync_from_main(self._network)  # what is written is what every process evaluates
        state: dict[str, Any] = {"format": checkpoint.FORMAT, "version": checkpoint.VERSION}
        if not sharded:
            state["network"] = self._strategy.full_state_dict(self._network)
        if training:
            optimizer_state, optimizer_type = (
                (None if sharded else self._strategy.full_optimizer_state(self._network, self._optimizer),
                 type(self._optimizer).__name__)
                if self._optimizer is not None else self._pending_optimizer or (None, None))
            state.update({
                "optimizer": optimizer_state,
                "optimizer_type": optimizer_type,
                "scaler": self._scaler.state_dict() if self._scaler is not None else self._pending_scaler_state,
                "epoch": self.epoch,
                "epoch_step": self.epoch_step,
                "step": self.step,
                "rng": checkpoint.rng_state(),
            })
            if len(self._optimizers) > 1:  # a train_step of the user's own: every optimizer, by name
                if sharded:
                    raise ValueError("save(sharded=True) holds one optimizer; this Model has "
                                     f"{len(self._optimizers)}. Save with sharded=False.")
                state.update(optimizer=None, optimizer_type=None, optimizers={
                    name: self._strategy.full_optimizer_state(self._network, optimizer)
                    for name, optimizer in self._optimizers.items()},
                    optimizer_types={name: type(o).__name__ for name, o in self._optimizers.items()})
            if resumable and self._fit_run is not None:
                run = self._fit_run
                state["fit"] = checkpoint.fit_state(
                    run.data_seed, distributed.consumed_items(run.train_loader, self.epoch_step),
                    state["rng"], self._metrics, run.callbacks)
        if sharded:
            optimizer = self._optimizer if training else None
            return checkpoint.save_sharded(path, state, functools.partial(
                distributed.save_shards, network=self._network, optimizer=optimizer), wait=wait)
        return checkpoint.save_state(path, state, wait=wait)

    def wait_for_saves(self) -> None:
        """Return once every ``save(..., wait=False)`` is on disk; raise if one failed.

        Every process must call it (it is collective, like ``save``). It also
        frees the CPU copy of the state that background saves keep for reuse.
        """
        checkpoint.wait_for_writes()
        checkpoint.release_staging()

    def load(self, path: str | os.PathLike, skip_mismatch: bool = False,
             reset_optimizer: bool = False, resume: bool = False) -> None:
        """Restore a checkpoint written by :meth:`save` (or a plain state_dict).

        Args:
            skip_mismatch: load only tensors whose names and shapes match,
                warning about the rest, instead of raising.
            reset_optimizer: keep the optimizer's current state.

        The optimizer's per-parameter state (momentum, Adam's moments, step
        counts) is restored, now or at the next ``prepare``; its settings
        (``lr``, ``betas``, ``weight_decay``, ...) stay those of the optimizer
        given to ``prepare``, whichever came first, and a warning names any
        the file had otherwise. ``resume=True`` restores the file's settings
        too (a schedule may have changed them).
            resume: also restore what continuing an interrupted ``fit`` needs
                -- RNG states, the data order and position in the epoch, the
                running figures and every callback's state -- from a file
                saved during ``fit``. Only from ``on_train_begin`` of a running
                fit (``callbacks.BackupAndRestore`` does this), on every
                process: each gets the copy furthest into training among the
                machines, so no shared file system is needed, even when a
                restart gives rank 0 to another machine.

        Raises:
            FileNotFoundError: no file at ``path`` / ``path.pt`` (with
                ``resume``: on no machine; raised on every process).
            hapi.checkpoint.CheckpointError: the file is damaged, carries code,
                or belongs to another architecture (the error names the keys).
        """
        if resume:
            checkpoint.check_fitting(fitting=self._fit_run is not None)  # before the collective
            file, state = checkpoint.load_freshest_state(path)
            checkpoint.check_resumable(file, state)
        else:
            file, state = checkpoint.load_state(path)
        skipped = (self._load_shards(file, state, skip_mismatch) if "shards" in state
                   else self._load_weights(file, state, skip_mismatch))
        if skipped:
            warnings.warn(f"Loaded {file!r} partially; skipped {len(skipped)} tensors whose name or "
                          f"shape do not match this network: {skipped}.", stacklevel=2)
        optimizer_state, optimizer_shards = state.get("optimizer"), state.get("optimizer_shards")
        if (optimizer_state is not None or optimizer_shards is not None) and not reset_optimizer:
            if skipped:
                warnings.warn("The optimizer state in the checkpoint was not loaded because the "
                              "network's weights did not match it.", stacklevel=2)
            elif self._optimizer is not None:
                self._restore_optimizer(file, state, keep_hyperparameters=not resume)
            elif optimizer_shards is None:
                self._pending_optimizer = (optimizer_state, state.get("optimizer_type"))
            else:  # shards are read into the optimizer's own (sharded) state: it must exist
                warnings.warn(f"The optimizer state in the sharded checkpoint {file!r} was not loaded: "
                              "this Model has no optimizer yet. Call prepare(optimizer=...) before load() "
                              "to restore it.", stacklevel=2)
        if state.get("optimizers") is not None and not reset_optimizer and not skipped:
            self._restore_optimizers(file, state, keep_hyperparameters=not resume)
        if state.get("scaler") is not None:
            if self._scaler is not None:
                self._scaler.load_state_dict(state["scaler"])
            else:
                self._pending_scaler_state = state["scaler"]
        self.epoch = int(state.get("epoch", 0))
        self.epoch_step = int(state.get("epoch_step", 0))
        self.step = int(state.get("step", 0))
        if resume:
            self._resume_fit(file, state)

    def _load_weights(self, file: str, state: dict, skip_mismatch: bool) -> list[str]:
        weights, skipped = checkpoint.match_state_dict(self._network, state["network"], file, skip_mismatch)
        self._strategy.load_state_dict(self._network, weights, strict=not skipped)
        return skipped

    def _load_shards(self, file: str, state: dict, skip_mismatch: bool) -> list[str]:
        """A sharded checkpoint's weights, resharded for this run (collectives)."""
        directory = checkpoint.shards_directory(file, state)
        saved = {key: torch.empty(shape, device="meta")
                 for key, shape in distributed.saved_shapes(directory).items()}
        weights, skipped = checkpoint.match_state_dict(self._network, saved, file, skip_mismatch)
        distributed.load_shards(directory, self._network, set(weights))
        return skipped

    def _restore_optimizer(self, file: str, state: dict, keep_hyperparameters: bool) -> None:
        """The checkpoint's optimizer state into this Model's optimizer: from the file, or its shards.

        ``keep_hyperparameters``: the settings given to prepare() win (a load);
        a resume takes the file's too, schedules having changed them.
        """
        shards = state.get("optimizer_shards")
        if shards is None:
            self._load_optimizer_state(state["optimizer"], state.get("optimizer_type"), source=file,
                                       keep_hyperparameters=keep_hyperparameters)
            return
        directory = checkpoint.shards_directory(file, state)
        checkpoint.load_optimizer_state(
            self._optimizer, {"param_groups": shards["param_groups"]}, state.get("optimizer_type"), file,
            load=lambda _: distributed.load_optimizer_shards(directory, self._network, self._optimizer, shards),
            keep_hyperparameters=keep_hyperparameters)

    def _restore_optimizers(self, file: str, state: dict, keep_hyperparameters: bool) -> None:
        """Several optimizers (a train_step of the user's own), matched by name."""
        saved = state["optimizers"]
        if sorted(saved) != sorted(self._optimizers):
            warnings.warn(
                f"{file!r} holds the states of optimizers {sorted(saved)}, but this Model was prepared "
                f"with {sorted(self._optimizers) or 'none'}; they were not loaded. Call prepare() with "
                "the same optimizers (a list in the same order, or a dict with the same names) before "
                "load().", stacklevel=3)
            return
        for name, optimizer_state in saved.items():
            checkpoint.load_optimizer_state(
                self._optimizers[name], optimizer_state, state["optimizer_types"][name], f"{file} ({name!r})",
                load=functools.partial(self._strategy.load_optimizer_state, self._network, self._optimizers[name]),
                keep_hyperparameters=keep_hyperparameters)

    def _resume_fit(self, file: str, state: dict) -> None:
        """Put the running fit back where the file left it."""
        run = self._fit_run
        run.data_seed = state["fit"]["data_seed"]
        distributed.set_seed(run.train_loader, run.data_seed)
        if not checkpoint.restore_fit(state["fit"], file, self._metrics, run.callbacks):
            # Another number of processes: the rest of the epoch's order, split anew
            # (or, where torch-hapi did not build the sampler, the whole epoch again).
            done = state["fit"].get("epoch_items")
            if done is not None and self.epoch_step:
                distributed.resume_at(run.train_loader, self.epoch, done)
            self.epoch_step = 0

    def _load_optimizer_state(self, optimizer_state: dict, saved_type: str | None, *,
                              source: str, keep_hyperparameters: bool) -> None:
        checkpoint.load_optimizer_state(
            self._optimizer, optimizer_state, saved_type, source,
            load=lambda state: self._strategy.load_optimizer_state(self._network, self._optimizer, state),
            keep_hyperparameters=keep_hyperparameters)

    def export(self, path: str | os.PathLike, example_inputs: Any, dynamic_batch: bool = True) -> str:
        """The network for inference through ``torch.export``; see :func:`hapi.export.export_network`.

        ``torch.export.load(path).module()`` runs it with no torch-hapi. Every process
        calls it; rank 0 writes. Returns the file written (``path`` + ``.pt2``).
        """
        from hapi.export import export_network, export_path  # torch.export only when exporting

        distributed.on_main(  # every process calls it, rank 0 writes (like save)
            lambda: export_network(self._network, path, example_inputs, dynamic_batch=dynamic_batch),
            lambda: RuntimeError(f"Rank 0 could not export to {export_path(path)!r}; see its error."))
        return export_path(path)

    def summary(self, input_size: Any = None, dtype: torch.dtype | None = None) -> dict[str, int]:
        """Print the layers and parameter counts; returns ``{"total_params", "trainable_params"}``.

        ``input_size`` (a shape with the batch dimension, e.g. ``(1, 1, 28, 28)``,
        or a list of shapes for several inputs) adds each layer's output shape.
        """
        return summarize(self._network, input_size, dtype, self.device)
