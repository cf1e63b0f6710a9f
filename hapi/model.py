"""``hapi.Model``: the public API. Checks arguments, builds loaders and callbacks, calls the loops.

The loop bodies live in :mod:`hapi.loops`, one batch in :mod:`hapi.steps`,
processes and devices in :mod:`hapi.distributed`, files in
:mod:`hapi.checkpoint`.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from hapi import distributed
from hapi.batches import BatchSplitter, batch_length
from hapi.callbacks import Callback, CallbackList, History
from hapi.callbacks.checks import require_int
from hapi.callbacks.run import callbacks_for_run
from hapi.data import make_loader, num_batches
from hapi.loops import Parts, evaluate_loop, fit_loop, predict_loop
from hapi.metrics import MetricSet, normalise_metrics
from hapi.model_io import ModelFiles
from hapi.own_steps import OwnSteps, named_optimizers
from hapi.steps import AMP_DTYPES, Stepper, check_amp, check_clipping, check_loss, make_scaler
from hapi.summary import summarize

DEFAULT_BATCH_SIZE = 32  # Keras' default; Paddle's is 1, which is rarely what anyone wants.
DEFAULT_LOG_FREQ = 10  # Paddle's default.


def _check_verbose(verbose: Any) -> None:
    if verbose not in (0, 1, 2):
        raise ValueError(
            f"verbose must be 0 (silent), 1 (progress bar) or 2 (one line per "
            f"log_freq steps); received {verbose!r}."
        )


@dataclass
class _FitRun:
    """The parts of a running fit that a backup saves and a resume restores."""

    callbacks: CallbackList
    train_loader: Any
    data_seed: int


class Model(OwnSteps, ModelFiles):
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

    def __init__(
        self,
        network: nn.Module,
        inputs: Any = None,
        labels: Any = None,
        device: str | torch.device | None = None,
    ) -> None:
        if not isinstance(network, nn.Module):
            raise TypeError(
                f"Model needs a torch.nn.Module; received {type(network).__name__}. "
                "Pass your network instance, e.g. Model(LeNet())."
            )
        distributed.setup(device)
        self.device = distributed.default_device(device)
        self._network = network.to(self.device)
        self._wrapped: nn.Module | None = None
        self._splitter = BatchSplitter.for_model(self.device, inputs, labels)
        self._optimizer: torch.optim.Optimizer | None = None
        self._optimizers: dict[
            str, torch.optim.Optimizer
        ] = {}  # by name ("0", "1", ... for a list)
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
    def prepare(
        self,
        optimizer: torch.optim.Optimizer | Sequence | dict | None = None,
        loss: Any = None,
        metrics: Any = None,
        amp: str | None = None,
        compile: bool = False,
        strategy: Any = None,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        loss_weights: Sequence[float] | None = None,
    ) -> None:
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
                "Model(network) to train with another strategy."
            )
        by_name = named_optimizers(optimizer)
        loss = check_loss(loss, loss_weights)
        named_metrics = normalise_metrics(metrics)
        self._strategy = chosen_strategy
        self._amp = check_amp(amp)
        self._compile = bool(compile)
        self._clipping = (clip_norm, clip_value)
        self._given_optimizers = optimizer
        self._optimizers = by_name
        self._optimizer = next(iter(by_name.values()), None)
        self._loss = loss.to(self.device) if isinstance(loss, nn.Module) else loss
        self._metrics = MetricSet(named_metrics, with_loss=loss is not None).to(self.device)
        self._splitter.labels_to_network = (
            loss is None
        )  # dict batches: the network computes its loss
        self._scaler = make_scaler(self._amp, self.device)
        self._stepper = None
        if self._pending_optimizer is not None and len(by_name) == 1:
            self._load_optimizer_state(
                *self._pending_optimizer, source="the loaded checkpoint", keep_hyperparameters=True
            )
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
            raise RuntimeError(
                f"{purpose}() needs an optimizer: call model.prepare(optimizer="
                "torch.optim.Adam(model.parameters()), loss=...) first."
            )
        own_step = self._overrides("train_step")
        if purpose in ("fit", "train_batch") and len(self._optimizers) > 1 and not own_step:
            raise RuntimeError(
                f"prepare() got {len(self._optimizers)} optimizers ({sorted(self._optimizers)}), but "
                "the built-in training step updates one. Override train_step(self, batch) in a "
                "subclass of Model to use several (a GAN's generator and discriminator), or pass one."
            )
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
                self._wrapped = self._strategy.wrap_network(
                    self._network, self.device, self._optimizer, AMP_DTYPES.get(self._amp)
                )
            self._stepper = None
        if self._stepper is None:
            train_network = self._network if self._wrapped is None else self._wrapped
            eval_network = self._network
            if self._compile:
                with (
                    warnings.catch_warnings()
                ):  # torch.compile's import of torch.utils.mkldnn warns
                    warnings.filterwarnings(
                        "ignore", r"`torch\.jit\.script_method` is", DeprecationWarning
                    )
                    train_network, eval_network = (
                        torch.compile(train_network),
                        torch.compile(eval_network),
                    )
            self._stepper = Stepper(
                train_network,
                self.device,
                self._loss,
                self._optimizer,
                self._amp,
                self._scaler,
                eval_network,
                self._strategy,
                *self._clipping,
            )
        steps = {
            name: getattr(self, name)
            for name in ("train_step", "eval_step", "predict_step")
            if self._overrides(name)
        }
        return Parts(self._stepper, self._metrics, self._splitter, **steps)

    def _prediction_parts(self) -> Parts:
        if self._metrics is not None:
            return self._parts("predict")
        return Parts(
            Stepper(self._network, self.device, strategy=self._strategy),
            MetricSet({}, False),
            self._splitter,
        )

    def _same_model_everywhere(self) -> None:
        """Before evaluating or predicting: every process scores rank 0's model (see
        :func:`hapi.distributed.sync_from_main`); weights too if DDP never aligned them."""
        distributed.sync_from_main(self._network, parameters=self._wrapped is None)

    def _run_setup(
        self,
        data: Any,
        role: str,
        callbacks: Any,
        *,
        batch_size: int,
        verbose: int,
        log_freq: int,
        num_workers: int,
        loader_options: dict | None = None,
        callback_options: dict | None = None,
        **params: Any,
    ) -> tuple[Any, CallbackList]:
        """The loader of ``data`` and the run's callbacks, their params set (fit, evaluate, predict)."""
        loader = make_loader(
            data,
            role=role,
            batch_size=batch_size,
            num_workers=num_workers,
            device=self.device,
            **(loader_options or {}),
        )
        cbks = callbacks_for_run(
            self, callbacks, verbose=verbose, log_freq=log_freq, **(callback_options or {})
        )
        params = {"epochs": None, "steps": num_batches(loader), **params}
        cbks.set_params(
            {
                "rank": distributed.rank(),
                "world_size": distributed.world_size(),
                "metrics": self._metrics.names() if self._metrics else [],
                "batch_size": distributed.loader_batch_size(loader) or batch_size,
                "verbose": verbose,
                "log_freq": log_freq,
                **params,
            }
        )
        return loader, cbks

    # -- fit / evaluate / predict -----------------------------------------------
    def fit(
        self,
        train_data: Any,
        eval_data: Any = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        epochs: int = 1,
        eval_freq: int = 1,
        log_freq: int = DEFAULT_LOG_FREQ,
        save_dir: str | None = None,
        save_freq: int = 1,
        verbose: int = 2,
        drop_last: bool = False,
        shuffle: bool = True,
        num_workers: int = 0,
        callbacks: Callback | list[Callback] | None = None,
        accumulate_grad_batches: int = 1,
        num_iters: int | None = None,
        eval_steps: int | None = None,
        resume_from: str | os.PathLike | None = None,
    ) -> History:
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
        for name, value in (
            ("epochs", epochs),
            ("eval_freq", eval_freq),
            ("log_freq", log_freq),
            ("save_freq", save_freq),
            ("accumulate_grad_batches", accumulate_grad_batches),
        ):
            require_int("fit", name, value)
        require_int("fit", "num_iters", num_iters, allow_none=True)
        require_int("fit", "eval_steps", eval_steps, allow_none=True)
        _check_verbose(verbose)
        if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
            raise TypeError(
                f"resume_from must be the path of a checkpoint saved during fit; received "
                f"{type(resume_from).__name__}."
            )
        if accumulate_grad_batches != 1 and parts.train_step is not None:
            raise ValueError(
                f"fit(accumulate_grad_batches={accumulate_grad_batches}) with a train_step of "
                f"your own ({type(self).__name__}): your step decides when to update; "
                "accumulate in it, or leave accumulate_grad_batches=1."
            )
        data_seed = distributed.shared_seed()
        train_loader, cbks = self._run_setup(
            train_data,
            "train_data",
            callbacks,
            batch_size=batch_size,
            verbose=verbose,
            log_freq=log_freq,
            num_workers=num_workers,
            loader_options={"shuffle": shuffle, "drop_last": drop_last, "seed": data_seed},
            callback_options={
                "save_dir": save_dir,
                "save_freq": save_freq,
                "resume_from": resume_from,
            },
            eval_steps=eval_steps,
            accumulate_grad_batches=accumulate_grad_batches,
            num_iters=num_iters,
        )
        eval_loader = (
            None
            if eval_data is None
            else make_loader(
                eval_data,
                role="eval_data",
                batch_size=batch_size,
                num_workers=num_workers,
                device=self.device,
            )
        )
        steps = num_batches(train_loader)
        if num_iters is not None and steps:
            epochs = math.ceil(num_iters / steps)
        cbks.set_params(
            {
                **next(iter(cbks)).params,
                "epochs": epochs,
                "steps": steps if num_iters is None else min(steps or num_iters, num_iters),
            }
        )
        self.stop_training = False
        self.epoch = self.epoch_step = 0
        self._fit_run = _FitRun(cbks, train_loader, data_seed)
        try:
            fit_loop(
                self,
                parts,
                train_loader,
                eval_loader,
                cbks,
                epochs=epochs,
                eval_freq=eval_freq,
                log_freq=log_freq,
                accumulate_grad_batches=accumulate_grad_batches,
                num_iters=num_iters,
                eval_steps=eval_steps,
            )
        except BaseException:
            distributed.note_failure()  # the others may wait in a collective: don't wait for them at exit
            raise
        finally:
            self._fit_run = None
        return next(c for c in cbks if isinstance(c, History))

    def evaluate(
        self,
        eval_data: Any,
        batch_size: int = DEFAULT_BATCH_SIZE,
        log_freq: int = DEFAULT_LOG_FREQ,
        verbose: int = 2,
        num_workers: int = 0,
        callbacks: Callback | list[Callback] | None = None,
        num_iters: int | None = None,
    ) -> dict[str, float]:
        """Figures over the whole of ``eval_data``: ``{"loss": float, <metric>: float}``."""
        parts = self._parts("evaluate")
        require_int("evaluate", "log_freq", log_freq)
        require_int("evaluate", "num_iters", num_iters, allow_none=True)
        _check_verbose(verbose)
        loader, cbks = self._run_setup(
            eval_data,
            "eval_data",
            callbacks,
            batch_size=batch_size,
            verbose=verbose,
            log_freq=log_freq,
            num_workers=num_workers,
        )
        self._same_model_everywhere()
        results = evaluate_loop(parts, loader, cbks, log_freq=log_freq, num_iters=num_iters)
        if not parts.metrics.names():  # known only now: a network may compute its own loss
            raise RuntimeError(
                "evaluate() had nothing to compute: call model.prepare(loss=..., "
                "metrics=...) with a loss or at least one metric (or return a 'loss' "
                "from the network)."
            )
        return results

    def predict(
        self,
        test_data: Any,
        batch_size: int = DEFAULT_BATCH_SIZE,
        num_workers: int = 0,
        stack_outputs: bool = False,
        verbose: int = 1,
        callbacks: Callback | list[Callback] | None = None,
    ) -> list:
        """The network's outputs over ``test_data``, in data-set order, on the CPU.

        Returns one entry per network output: a list of per-batch tensors, or
        one tensor with the batches concatenated when ``stack_outputs``.
        Samples are split as in training and only the inputs are used, so a
        data set with labels predicts as is.
        """
        parts = self._prediction_parts()
        _check_verbose(verbose)
        loader, cbks = self._run_setup(
            test_data,
            "test_data",
            callbacks,
            batch_size=batch_size,
            verbose=verbose,
            log_freq=DEFAULT_LOG_FREQ,
            num_workers=num_workers,
        )
        self._same_model_everywhere()
        outputs = predict_loop(parts, loader, cbks)
        if stack_outputs:
            return [
                torch.cat(batches) if batches and torch.is_tensor(batches[0]) else batches
                for batches in outputs
            ]
        return outputs

    # -- one batch, Paddle style --------------------------------------------------
    def train_batch(self, inputs: Any, labels: Any = None, update: bool = True) -> dict[str, float]:
        """One training step; returns this batch's ``{"loss": ..., <metric>: ...}``.

        With ``update=False`` gradients accumulate until a later call updates.
        """
        parts = self._parts("train_batch")
        parts.stepper.network.train()
        inputs_, labels_ = self._splitter.user_batch(inputs, labels)
        loss, outputs = parts.stepper.train(inputs_, labels_, update=update)
        self.step += int(update)
        return self._batch_figures(parts, loss, outputs, labels_)

    def eval_batch(self, inputs: Any, labels: Any = None) -> dict[str, float]:
        """Evaluate one batch; returns its ``{"loss": ..., <metric>: ...}``."""
        parts = self._parts("eval_batch")
        parts.stepper.network.eval()
        inputs_, labels_ = self._splitter.user_batch(inputs, labels)
        loss, outputs = parts.stepper.evaluate(inputs_, labels_)
        return self._batch_figures(parts, loss, outputs, labels_)

    def predict_batch(self, inputs: Any) -> list[torch.Tensor]:
        """The network's outputs for one batch of inputs, as CPU tensors."""
        parts = self._prediction_parts()
        parts.stepper.network.eval()
        inputs_, _ = self._splitter.user_batch(inputs, None)
        return [o.cpu() for o in parts.stepper.predict(inputs_)]

    @staticmethod
    def _batch_figures(
        parts: Parts, loss: torch.Tensor | None, outputs: list, labels: list
    ) -> dict[str, float]:
        """Figures of this batch alone (Paddle keeps running ones; one batch is clearer)."""
        if not labels:
            return {} if loss is None else {"loss": loss.item()}
        parts.metrics.reset()
        parts.metrics.update(loss, outputs, labels, batch_length(outputs, labels))
        return parts.metrics.compute(sync=False)  # this process's batch: no collective

    def summary(self, input_size: Any = None, dtype: torch.dtype | None = None) -> dict[str, int]:
        """Print the layers and parameter counts; returns ``{"total_params", "trainable_params"}``.

        ``input_size`` (a shape with the batch dimension, e.g. ``(1, 1, 28, 28)``,
        or a list of shapes for several inputs) adds each layer's output shape.
        """
        return summarize(self._network, input_size, dtype, self.device)
