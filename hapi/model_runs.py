"""``fit``, ``evaluate``, ``predict`` and the one-batch calls of :class:`hapi.Model`.

:class:`ModelRuns` is a part of Model (a mixin): it checks the arguments of a
run, builds its loader and callbacks, and calls the loops of
:mod:`hapi.loops`.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from hapi import distributed
from hapi.batches import batch_length
from hapi.callbacks import Callback, CallbackList, History
from hapi.callbacks.checks import require_int
from hapi.callbacks.run import callbacks_for_run
from hapi.data import make_loader, num_batches
from hapi.fit_data import as_source, batch_sizes, fit_seed
from hapi.loops import Parts, evaluate_loop, fit_loop, predict_loop
from hapi.seed import streams_for_training
from hapi.train_data import TrainData

DEFAULT_BATCH_SIZE = 32  # Keras' default; Paddle's is 1, which is rarely what anyone wants.
DEFAULT_LOG_FREQ = 10  # Paddle's default.


def _check_verbose(verbose: Any) -> None:
    if verbose not in (0, 1, 2, 3):
        raise ValueError(
            f"verbose must be 0 (silent), 1 (progress bar), 2 (one line per log_freq steps) "
            f"or 3 (lines with Paddle's time counters); received {verbose!r}."
        )


@dataclass
class _FitRun:
    """The parts of a running fit that a backup saves and a resume restores."""

    callbacks: CallbackList
    train_data: TrainData
    data_seed: int
    epochs: int
    restoring: bool = False  # between on_train_begin and the first epoch: a resume may load


class ModelRuns:
    """Model's runs: ``fit``, ``evaluate``, ``predict``, ``train_batch``, ``eval_batch``, ``predict_batch``."""

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
        batch_size: int | tuple[int, int] = DEFAULT_BATCH_SIZE,
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
        """Train the network on ``train_data``, evaluating on ``eval_data`` as it goes.

        Each epoch reshuffles the data, runs the training step on every batch
        (the built-in one, or your :meth:`train_step`), evaluates when due and
        calls the callbacks' hooks (see :class:`callbacks.Callback` for their
        order and ``logs``). Logged figures are running means over the epoch,
        reduced across processes, so every process sees the same numbers. On
        several processes each one trains on its own shard of every epoch, and
        the start states the world size and the global batch.

        Args:
            train_data: a ``Dataset`` or any map-style object (``__len__`` and
                ``__getitem__(int)``, e.g. a Hugging Face ``datasets.Dataset``),
                a list of samples (tuples or dicts), an ``IterableDataset``, a
                ``DataLoader`` (used as given on one process, re-sharded on
                several), or a tuple of tensors/arrays ``(x, y)``. By default
                every element of a sample but the last feeds the network and
                the last is the label (``Model(inputs=, labels=)`` change it).
            eval_data: the same kinds, evaluated when ``epoch % eval_freq == 0``
                (0-based, as in Paddle); its figures reach ``on_epoch_end`` as
                ``val_<name>``. ``None``: no evaluation.
            batch_size: samples per batch **per process** (as in Paddle): an int,
                or a pair ``(train, eval)`` whose second size batches
                ``eval_data``. Ignored for a ``DataLoader``, which keeps its own.
            epochs: passes over ``train_data``.
            eval_freq: evaluate every this many epochs.
            log_freq: steps between the figures the progress display and batch
                callbacks receive (reading figures makes the host wait for the
                device, so not every step).
            save_dir: a directory to save checkpoints in: adds a
                ``ModelCheckpoint(save_dir, save_freq=save_freq)`` unless
                ``callbacks`` holds one.
            save_freq: epochs between those checkpoints.
            verbose: 0 silent, 1 a progress bar, 2 one line per ``log_freq``
                steps and per epoch, 3 lines with Paddle's time counters. Only
                the main process prints.
            drop_last: drop each epoch's last, incomplete batch.
            shuffle: reshuffle the training data every epoch, in an order that
                follows one number drawn from torch's global generator when
                ``fit`` starts (the only draw torch-hapi makes from the global
                generators). With ``shuffle=False`` over tensors, a list of
                samples, or a data set marked ``draws_random_numbers = False``,
                nothing is drawn, so a network with dropout trains bit for bit
                as a hand-written loop seeded alike.
            num_workers: ``DataLoader`` worker processes loading batches.
                ``batch_size``, ``shuffle``, ``drop_last`` and ``num_workers``
                do not apply to a ``DataLoader``, which keeps its own.
            callbacks: a :class:`callbacks.Callback` or a list of them, added to
                the defaults (a progress display unless ``verbose=0``, and
                :class:`callbacks.History`).
            accumulate_grad_batches: average gradients over this many batches
                before each optimizer step (a larger effective batch in the
                same memory); on several processes the gradient average is
                skipped on the batches in between.
            num_iters: the number of training batches in total: ``epochs``
                becomes ceil(num_iters / batches per epoch), as in Paddle, and
                the last epoch stops early when needed. ``None``: whole epochs.
            eval_steps: also evaluate ``eval_data`` every this many optimizer
                steps (Hugging Face's ``eval_steps``, Lightning's integer
                ``val_check_interval``), besides the per-epoch evaluation; its
                figures reach callbacks through ``on_eval_end`` and
                :class:`callbacks.History` keeps each at its step
                (``history.evaluations``).
            resume_from: the path of a resumable checkpoint
                (``BackupAndRestore``'s backup, ``ModelCheckpoint(resumable=True)``)
                to continue: the same final weights as if the fit had never
                stopped.

        Returns:
            The run's :class:`callbacks.History`: ``history.history`` maps
            ``"loss"``, each metric name and ``"val_" + name`` to one value per
            epoch.

        Raises:
            RuntimeError: ``prepare`` was not called, or gave no optimizer (the
                message says what to call).
            ValueError: a count (``epochs``, ``log_freq``, ...) that is not a
                positive int, an unknown ``verbose``, data that gives no batch,
                or ``accumulate_grad_batches`` with a :meth:`train_step` of
                your own.
            TypeError: data of a kind torch-hapi cannot batch, callbacks that
                are not ``Callback`` objects, or a ``resume_from`` that is no path.

        Example:
            .. code-block:: python

                history = model.fit(train, eval_data=test, epochs=2, batch_size=64,
                                    callbacks=[callbacks.EarlyStopping(patience=2)])
                history.history["val_loss"]  # one float per epoch
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
        train_batch_size, eval_batch_size = batch_sizes(batch_size)
        train_source = as_source(train_data, "train_data")  # refused before anything is drawn
        eval_source = as_source(eval_data, "eval_data")
        streams_for_training()  # after seed_everything: each process its own stream from here
        data_seed = fit_seed(train_source, shuffle)
        train_loader, cbks = self._run_setup(
            train_source,
            "train_data",
            callbacks,
            batch_size=train_batch_size,
            verbose=verbose,
            log_freq=log_freq,
            num_workers=num_workers,
            loader_options={"shuffle": shuffle, "drop_last": drop_last, "seed": data_seed},
            callback_options={"save_dir": save_dir, "save_freq": save_freq},
            eval_steps=eval_steps,
            **({} if save_dir is None else {"save_dir": save_dir}),  # EarlyStopping's best_model
            accumulate_grad_batches=accumulate_grad_batches,
            num_iters=num_iters,
        )
        eval_loader = (
            None
            if eval_source is None
            else make_loader(
                eval_source,
                role="eval_data",
                batch_size=eval_batch_size,
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
        train = TrainData(train_loader, train_data, data_seed)
        inexact = train.inexact_reason()
        if inexact and (resume_from is not None or any(getattr(c, "resumable", 0) for c in cbks)):
            warnings.warn(
                f"This fit writes or reads checkpoints to resume from, but a resumed epoch will "
                f"not equal the uninterrupted one: {inexact}.",
                stacklevel=2,
            )
        self._fit_run = _FitRun(cbks, train, data_seed, epochs)
        try:
            fit_loop(
                self,
                parts,
                train,
                eval_loader,
                cbks,
                epochs=epochs,
                eval_freq=eval_freq,
                log_freq=log_freq,
                accumulate_grad_batches=accumulate_grad_batches,
                num_iters=num_iters,
                eval_steps=eval_steps,
                restore=lambda: self._restore_fit(resume_from),
            )
        except BaseException:
            distributed.note_failure()  # the others may wait in a collective: don't wait for them at exit
            raise
        finally:
            self._fit_run = None
        return next(c for c in cbks if isinstance(c, History))

    def _restore_fit(self, resume_from: str | os.PathLike | None) -> None:
        """Continue an interrupted fit, after every callback's ``on_train_begin`` and before the
        first batch: from ``resume_from``, then from a backup a callback keeps (its
        ``restore_backup()``, as :class:`callbacks.BackupAndRestore` has), the later winning.

        The loop then starts at the restored epoch and step; nothing rewrites it once it runs.
        """
        run = self._fit_run
        run.restoring = True
        try:
            if resume_from is not None:
                self.load(resume_from, resume=True)
                if distributed.is_main():  # as BackupAndRestore says it: no silent resume
                    tqdm.write(
                        f"Resuming from {os.fspath(resume_from)} at epoch {self.epoch + 1}, batch "
                        f"{self.epoch_step} (optimizer step {self.step})."
                    )
            for callback in run.callbacks:
                restore_backup = getattr(callback, "restore_backup", None)
                if callable(restore_backup):
                    restore_backup()
        finally:
            run.restoring = False

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
        """Score the network on the whole of ``eval_data``, with no training.

        On several processes the data is split without duplicates and the
        figures reduced, so every process returns exactly what one process
        returns on the same data. A callback that sets ``model.stop_evaluating``
        ends the evaluation after that batch; the figures cover the batches seen.

        Args:
            eval_data: any data :meth:`fit` accepts (a dataset, a list of
                samples, a ``DataLoader``, a tuple ``(x, y)``, ...).
            batch_size: samples per batch, per process.
            log_freq: steps between the figures shown and given to batch callbacks.
            verbose: 0 silent, 1 a progress bar, 2 lines, 3 lines with Paddle's
                time counters.
            num_workers: ``DataLoader`` worker processes.
            callbacks: a :class:`callbacks.Callback` or a list of them; their
                ``on_eval_*`` hooks run.
            num_iters: evaluate only this many batches (``None``: all).

        Returns:
            ``{"loss": float, <metric name>: float, ...}`` over the data seen
            (``"loss"`` when a loss is set or the network returns one); ``{}``
            when there is nothing to compute, as in Paddle.

        Raises:
            RuntimeError: ``prepare`` was not called.
            ValueError: ``log_freq``/``num_iters`` not positive ints, or an
                unknown ``verbose``.
        """
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
        return evaluate_loop(
            parts, loader, cbks, log_freq=log_freq, num_iters=num_iters, model=self
        )

    def predict(
        self,
        test_data: Any,
        batch_size: int = DEFAULT_BATCH_SIZE,
        num_workers: int = 0,
        stack_outputs: bool = False,
        verbose: int = 1,
        callbacks: Callback | list[Callback] | None = None,
    ) -> list:
        """Run the network over ``test_data`` and collect its outputs, in data-set order.

        Works without ``prepare``. Samples are split as in training and only
        the inputs are used, so a data set with labels predicts as is. On
        several processes each predicts a shard and every process returns the
        whole, in order. A callback that sets ``model.stop_predicting`` ends the
        prediction after that batch.

        Args:
            test_data: any data :meth:`fit` accepts.
            batch_size: samples per batch, per process.
            num_workers: ``DataLoader`` worker processes.
            stack_outputs: concatenate each output's batches into one tensor.
            verbose: 0 silent, 1 a progress bar, 2 or 3 lines.
            callbacks: a :class:`callbacks.Callback` or a list of them; their
                ``on_predict_*`` hooks run.

        Returns:
            A list with one entry per network output, on the CPU: a list of
            per-batch tensors, or one tensor when ``stack_outputs``.

        Raises:
            ValueError: an unknown ``verbose``.
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
        outputs = predict_loop(parts, loader, cbks, model=self)
        if stack_outputs:
            return [
                torch.cat(batches) if batches and torch.is_tensor(batches[0]) else batches
                for batches in outputs
            ]
        return outputs

    # -- one batch, Paddle style --------------------------------------------------
    def train_batch(self, inputs: Any, labels: Any = None, update: bool = True) -> dict[str, float]:
        """One training step on one batch, Paddle-style, for loops of your own.

        Args:
            inputs: the network's input(s): a tensor, a list of tensors, or a
                whole batch (a tuple or dict) to split as ``fit`` does when
                ``labels`` is ``None``.
            labels: the label(s) for the loss and metrics, or ``None``.
            update: step the optimizer. With ``update=False`` the gradients
                accumulate until a later call updates.

        Returns:
            This batch's figures, ``{"loss": float, <metric name>: float}``
            (this process's batch alone, not a running mean).

        Raises:
            RuntimeError: ``prepare`` was not called or gave no optimizer.
        """
        parts = self._parts("train_batch")
        parts.stepper.network.train()
        inputs_, labels_ = self._splitter.user_batch(inputs, labels)
        loss, outputs = parts.stepper.train(inputs_, labels_, update=update)
        self.step += int(update)
        return self._batch_figures(parts, loss, outputs, labels_)

    def eval_batch(self, inputs: Any, labels: Any = None) -> dict[str, float]:
        """Evaluate one batch, with no gradients and the network in eval mode.

        Args:
            inputs: the network's input(s), or a whole batch to split when
                ``labels`` is ``None``.
            labels: the label(s) for the loss and metrics, or ``None``.

        Returns:
            This batch's figures, ``{"loss": float, <metric name>: float}``.

        Raises:
            RuntimeError: ``prepare`` was not called.
        """
        parts = self._parts("eval_batch")
        parts.stepper.network.eval()
        inputs_, labels_ = self._splitter.user_batch(inputs, labels)
        loss, outputs = parts.stepper.evaluate(inputs_, labels_, self._splitter.n_labels == 0)
        return self._batch_figures(parts, loss, outputs, labels_)

    def predict_batch(self, inputs: Any) -> list[torch.Tensor]:
        """The network's outputs for one batch of inputs (eval mode, no gradients).

        Args:
            inputs: the network's input(s): a tensor, a list of them, or a
                whole batch whose labels are dropped.

        Returns:
            A list with one CPU tensor per network output.
        """
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
