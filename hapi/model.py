"""``hapi.Model``: the public API, and the loops it runs. Holds the network and what ``prepare`` chose.

``prepare``; ``fit``/``evaluate``/``predict`` (argument checks, the loader
and callbacks of a run, then the loops below); the built-in steps, which are
the default ``train_step``/``eval_step``/``predict_step`` a subclass
overrides, with ``backward``/``optimizer_step``/``autocast`` for steps of
one's own; the one-batch calls; ``save``/``load``/``export``, which
:mod:`hapi.state` carries out. One
batch's mechanics are :mod:`hapi.steps`, processes and devices
:mod:`hapi.distributed`.

Read top to bottom, ``fit_loop`` is the whole of training::

    on_train_begin
    restore an interrupted fit's state (resume_from, BackupAndRestore)
    for epoch in range(model.epoch, epochs):
        on_epoch_begin(epoch)
        for each batch:  on_train_batch_begin / model.train_step / on_train_batch_end
        every eval_steps optimizer steps (mid-epoch, when asked): an evaluation
        every eval_freq epochs (epoch % eval_freq == 0, as in Paddle):
            on_eval_begin / on_eval_batch_* / on_eval_end
        on_epoch_end(epoch, train logs + val_ logs)
        stop when any process set model.stop_training (checked at the epoch end,
        and every log_freq steps when a batch callback could set it; after every
        batch on one process, where asking costs nothing), or num_iters is reached
    on_train_end

``evaluate_loop`` and ``predict_loop`` end early, after a batch, when a callback sets
``model.stop_evaluating`` / ``model.stop_predicting`` (Keras 3; see :func:`_stop_check`).
Logs reach the host only every ``log_freq`` steps and at the end of a pass
(:meth:`MetricSet.compute`); nothing in the loops depends on which process runs them
(that is :mod:`hapi.distributed`'s job).
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from hapi import checkpoint, data, distributed
from hapi import state as run_state
from hapi.amp import AMP_DTYPES, make_scaler, parse_amp
from hapi.batches import BatchSplitter, batch_length
from hapi.callbacks import Callback, CallbackList, History
from hapi.callbacks.run import callbacks_for_run
from hapi.messages import require_int, warn
from hapi.metrics import MetricSet, normalise_metrics
from hapi.rng import streams_for_training
from hapi.steps import Stepper, as_list, check_clipping, check_loss, optimized_parameters
from hapi.summary import count_flops, summarize

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
    """A running fit: what its loop reads, and the parts that a backup saves and a resume
    restores (the callbacks, the training data with its seed, the epochs)."""

    callbacks: CallbackList
    train_data: data.TrainData
    eval_loader: Iterable | None
    eval_freq: int
    log_freq: int
    epochs: int
    accumulate_grad_batches: int  # batches per optimizer step
    num_iters: int | None
    eval_steps: int | None
    restoring: bool = False  # between on_train_begin and the first epoch: a resume may load


def named_optimizers(optimizer: Any) -> dict[str, torch.optim.Optimizer]:
    """``prepare``'s optimizer(s) by name: one, a list (names "0", "1", ...) or a dict."""
    if optimizer is None:
        return {}
    named = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    named = dict(enumerate(named)) if isinstance(named, (list, tuple)) else named
    optimizers = list(named.values()) if isinstance(named, dict) else []
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, or a list or dict of them (for a "
            f"train_step of your own); received {optimizer!r:.200}. Example: "
            "torch.optim.Adam(model.parameters(), lr=1e-3)."
        )
    return {str(name): o for name, o in named.items()}


class Model:
    """Wraps an ``nn.Module`` with ``prepare``/``fit``/``evaluate``/``predict``.

    The same script runs on one CPU, one GPU, or several processes under
    ``torchrun``/:func:`hapi.spawn`/Slurm: building a ``Model`` joins the process
    group when the launcher asked for several processes, so nothing in the script
    tests a rank. Subclass it and override :meth:`train_step` (and
    :meth:`eval_step`/:meth:`predict_step`) to write the step yourself.

    Args:
        network: the user's module. ``model.network`` always returns it,
            never a distributed wrapper, so its ``state_dict`` and attributes
            are the ones you wrote.
        inputs: how many leading elements of each sample feed the network
            (an int, or a list of names/specs whose length counts). Default:
            every element but the last. With dict samples, the keys that are
            not labels go to the network as keyword arguments.
        labels: how many elements after the inputs go to the loss (an int, or
            a list). With dict samples: the label keys (default ``"labels"``,
            else ``"label"``, when present). Default: the last element.
        device: where to train (``"cpu"``, ``"cuda:1"``, a ``torch.device``).
            ``None`` picks ``cuda:LOCAL_RANK`` when CUDA is available, else the
            CPU.

    Attributes:
        device: the ``torch.device`` the network lives on.
        stop_training: set it to ``True`` in a callback to end ``fit``: checked
            at each epoch's end, and from a batch hook every ``log_freq`` steps
            (every step on one process); every process stops at the same step.
        stop_evaluating: set it in ``on_eval_batch_end`` to end ``evaluate``
            after that batch (reset by each evaluation).
        stop_predicting: set it in ``on_predict_batch_end`` to end ``predict``
            after that batch (reset by each prediction).
        epoch: epochs completed in the current ``fit`` (restored by ``load``).
        epoch_step: batches done in the epoch in progress (restored by ``load``).
        step: optimizer steps taken over the model's life (restored by ``load``).

    Raises:
        TypeError: ``network`` is not an ``nn.Module``.
        hapi.distributed.DistributedSetupError: the launcher's environment asks
            for several processes but the process group cannot be formed.

    Example:
        .. code-block:: python

            model = hapi.Model(torch.nn.Linear(4, 2))
            model.prepare(torch.optim.SGD(model.parameters(), lr=0.1),
                          torch.nn.CrossEntropyLoss())
            history = model.fit((torch.randn(64, 4), torch.randint(0, 2, (64,))),
                                epochs=2, verbose=0)
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
        distributed.init(device)
        self.device = distributed.default_device(device)
        self._network = network.to(self.device)
        self._wrapped: nn.Module | None = None
        self._splitter = BatchSplitter.for_model(self.device, inputs, labels)
        self._optimizer: torch.optim.Optimizer | None = None
        # By name ("0", "1", ... for a list).
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
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
        # Keras 3: a callback sets stop_evaluating / stop_predicting in on_eval_batch_end /
        # on_predict_batch_end to end evaluate / predict after that batch; each evaluation and
        # prediction resets them.
        self.stop_training = self.stop_evaluating = self.stop_predicting = False
        # Epochs completed in the current fit, batches done in the epoch in progress, optimizer
        # steps taken over the model's life: all three restored by load.
        self.epoch = self.epoch_step = self.step = 0
        self._fit_run: _FitRun | None = None  # what a resume needs, while fit() runs

    # -- public attributes ------------------------------------------------
    @property
    def network(self) -> nn.Module:
        """The user's module, never a ``DistributedDataParallel``/FSDP wrapper or compiled copy.

        Read weights, call submodules or save a ``state_dict`` through it: its
        keys have no ``module.`` prefix on any number of processes.
        """
        return self._network

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer given to ``prepare`` (with several, the first); ``None`` before.

        Callbacks read and change its ``param_groups`` (learning-rate schedules).
        """
        return self._optimizer

    @property
    def optimizers(self) -> Any:
        """The optimizer(s) exactly as given to ``prepare``: one, a list or a dict.

        A :meth:`train_step` of your own reads its optimizers here (a GAN's
        ``self.optimizers["g"]`` and ``self.optimizers["d"]``).
        """
        return self._given_optimizers

    def get_weights(self) -> dict[str, Any]:
        """The network's weights as full, plain CPU tensors, whatever the strategy (Keras' name).

        A copy that later training leaves as it is: what ``EarlyStopping``
        keeps of the best epoch, or an average of weights. Whole even under
        FSDP, where each process holds a shard of each parameter (the shards
        are gathered: every process must call it then), and the same on every
        process. ``torch.save(model.get_weights(), path)`` writes a plain
        ``state_dict`` that the network loads with no torch-hapi.

        Returns:
            The network's ``state_dict`` keys (no ``module.`` prefix) mapped to
            CPU tensors (a module's extra state, such as ``get_extra_state``
            returns, is deep-copied as it is).
        """
        copied = {}
        for key, value in distributed.full_state_dict(self._network).items():
            tensor = torch.is_tensor(value)
            copied[key] = value.detach().to("cpu", copy=True) if tensor else copy.deepcopy(value)
        return copied

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load full weights, such as :meth:`get_weights` returned, whatever the strategy.

        Every process passes the same full tensors; under FSDP each keeps its
        own shard of them, with no communication.

        Args:
            weights: every key of the network's ``state_dict`` mapped to a
                tensor of its shape (on any device).

        Raises:
            TypeError: ``weights`` is not a dict.
            ValueError: keys are missing or unexpected, or a shape differs (the
                message names them).
        """
        if not isinstance(weights, dict):
            raise TypeError(
                f"set_weights() takes a dict of tensors by name, as get_weights() returns; "
                f"received {type(weights).__name__}."
            )
        try:
            distributed.load_full_state_dict(self._network, weights)
        except RuntimeError as error:
            raise ValueError(
                f"set_weights(): these weights do not fit {type(self._network).__name__}: "
                f"{' '.join(str(error).split()).rstrip('.')}. Pass what get_weights() returned."
            ) from error

    def parameters(self) -> list[nn.Parameter]:
        """The network's parameters, to build the optimizer before ``prepare``.

        Returns:
            A list of the network's ``nn.Parameter`` objects, as
            ``model.network.parameters()`` yields them.
        """
        return list(self._network.parameters())

    if not TYPE_CHECKING:  # a type checker keeps flagging misspelt attributes

        def __getattr__(self, name: str) -> Any:
            """Only for a missing name: another library's name gets torch-hapi's in the error."""
            if name in _KERAS_NAMES:
                raise AttributeError(
                    f"Model has no {name}(), Keras's name: torch-hapi calls it "
                    f"model.{_KERAS_NAMES[name]}.",
                    name=name,
                    obj=self,
                )
            return object.__getattribute__(self, name)  # the usual error, or a property's own

    # -- preparation --------------------------------------------------------
    def prepare(
        self,
        optimizer: torch.optim.Optimizer | Sequence | dict | None = None,
        loss: Any = None,
        metrics: Any = None,
        amp: str | dict | None = None,
        compile: bool = False,
        strategy: Any = None,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        loss_weights: Sequence[float] | None = None,
        amp_configs: str | dict | None = None,
    ) -> None:
        """Set what training and evaluation use: optimizer, loss, metrics and how to run them.

        Call it before ``fit``/``evaluate``/``train_batch`` (``predict`` works
        without). Calling it again replaces the settings; the weights and the
        counters stay. Nothing is wrapped for several processes here: that
        happens when training first needs it, so an evaluate-only script never
        builds DDP.

        Args:
            optimizer: a ``torch.optim.Optimizer`` over ``model.parameters()``
                (or over a part of them, to fine-tune only that part: the rest
                keeps its values); or a list or dict of them for a
                ``train_step`` of your own (a GAN's two), all saved in
                checkpoints. One that holds none of the network's parameters
                (built over another module) is refused: it would train nothing.
            loss: a callable ``loss(*outputs, *labels)`` returning a scalar,
                e.g. ``torch.nn.CrossEntropyLoss()``.
            metrics: a ``torchmetrics.Metric``, a list of them, or a dict
                name -> metric. A dict's keys are the names in every ``logs``
                dict; otherwise each metric is named by its class in snake_case
                (``MulticlassAccuracy`` -> ``multiclass_accuracy``, with
                ``_2``, ``_3`` for repeats), and :class:`hapi.metrics.Accuracy`
                by its own names (``acc``, or ``acc_top1``, ``acc_top2``). A
                metric whose ``compute()`` returns a dict (a
                ``MetricCollection``) logs each of its keys.
            amp: mixed precision. ``None`` (float32), ``"bf16"`` (autocast to
                bfloat16) or ``"fp16"`` (float16 autocast with a gradient
                scaler); or Paddle's ``amp_configs``: ``"O0"`` (float32),
                ``"O1"`` (= ``"fp16"``), or a dict such as ``{"level": "O1",
                "init_loss_scaling": 1024, "incr_ratio": 2.0, "decr_ratio":
                0.5, "incr_every_n_steps": 1000, "use_dynamic_loss_scaling":
                True, "dtype": "float16"}`` (``level`` defaults to ``"O1"``;
                ``dtype`` may be ``"bfloat16"``, then without loss scaling).
                The scaler keys set ``torch.amp.GradScaler``'s ``init_scale``,
                ``growth_factor``, ``backoff_factor`` and ``growth_interval``;
                ``use_dynamic_loss_scaling=False`` keeps the scale fixed.
                What torch has no equivalent for (``"O2"``, per-op
                ``custom_white_list``/``custom_black_list``,
                ``decr_every_n_nan_or_inf`` other than 1, static-graph keys)
                raises a ``ValueError`` saying what to use instead; see
                :mod:`hapi.amp`.
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
            amp_configs: Paddle's name for ``amp`` (give one of the two).

        Raises:
            ValueError: an ``amp`` setting torch-hapi cannot honour (see above),
                both ``amp`` and ``amp_configs``, a bad clipping value or
                ``loss_weights`` that do not match the losses, or an
                optimizer holding none of the network's parameters.
            TypeError: an optimizer, loss, metric or strategy of the wrong kind
                (the message says what is accepted).
            RuntimeError: a different ``strategy`` after this Model already
                trained on several processes (build a new Model instead), or a
                call from a callback while ``fit`` runs.
        """
        if self._fit_run is not None:
            raise RuntimeError(
                "prepare() was called while fit() runs (from a callback?): the running fit keeps "
                "its optimizer, loss and metrics. Change a setting in place instead (the learning "
                "rate in model.optimizer.param_groups), or call prepare() before fit()."
            )
        chosen_strategy = distributed.resolve_strategy(strategy)
        if amp_configs is not None and amp is not None:
            raise ValueError(
                f"prepare() got amp={amp!r} and amp_configs={amp_configs!r}; amp_configs is "
                "Paddle's name for amp: pass one of them."
            )
        amp_setting = parse_amp(amp if amp_configs is None else amp_configs)
        clip_norm, clip_value = check_clipping(clip_grad_norm, clip_grad_value)
        wrapped_for_several = self._wrapped is not None and distributed.world_size() > 1
        if wrapped_for_several and chosen_strategy != self._strategy:
            raise RuntimeError(
                f"prepare(strategy={chosen_strategy!r}) after this Model trained with "
                f"{self._strategy!r}, which wraps the network. Build a new Model(network) instead."
            )
        by_name = named_optimizers(optimizer)
        loss = check_loss(loss, loss_weights)
        if not self._overrides("train_step"):  # a step of one's own may train more than the network
            _check_trains_network(by_name, self._network, loss)
        named_metrics = normalise_metrics(metrics)
        self._strategy = chosen_strategy
        self._amp = amp_setting.name
        self._compile = bool(compile)
        self._clipping = (clip_norm, clip_value)
        self._given_optimizers = optimizer
        self._optimizers = by_name
        self._optimizer = next(iter(by_name.values()), None)
        self._loss = loss.to(self.device) if isinstance(loss, nn.Module) else loss
        self._metrics = MetricSet(named_metrics, with_loss=loss is not None).to(self.device)
        # Dict batches with no loss given: the network computes its loss from the labels.
        self._splitter.labels_to_network = loss is None
        self._scaler = make_scaler(amp_setting, self.device)
        self._stepper = None
        if self._pending_optimizer is not None and len(by_name) == 1:
            state, kind = self._pending_optimizer
            run_state.load_optimizer_state(
                self, state, kind, source="the loaded checkpoint", keep_hyperparameters=True
            )
            self._pending_optimizer = None
        if self._pending_scaler_state is not None and self._scaler is not None:
            self._scaler.load_state_dict(self._pending_scaler_state)
            self._pending_scaler_state = None

    def _stepper_for(self, purpose: str) -> Stepper:
        """The step's parts, checked ready for ``purpose`` and built (DDP, compile) on first need.

        Prediction needs no ``prepare``: then a step with no loss and no optimizer."""
        if self._metrics is None and purpose != "predict":
            raise RuntimeError(
                f"{purpose}() needs a prepared model: call model.prepare(optimizer=..., "
                f"loss=..., metrics=...) before model.{purpose}()."
            )
        training = purpose in ("fit", "train_batch")
        if training and self._optimizer is None:
            raise RuntimeError(
                f"{purpose}() needs an optimizer: call model.prepare(optimizer="
                "torch.optim.Adam(model.parameters()), loss=...) first."
            )
        own_step = self._overrides("train_step")
        if training and len(self._optimizers) > 1 and not own_step:
            raise RuntimeError(
                f"prepare() got {len(self._optimizers)} optimizers ({sorted(self._optimizers)}), but "
                "the built-in step updates one. Override train_step(self, batch), or pass one."
            )
        if training and self._wrapped is None:
            if own_step:
                # The user's step runs the plain network; Stepper.update averages the
                # gradients. Every process starts from rank 0's weights.
                self._strategy._check_own_step(type(self).__name__)
                distributed.sync_from_main(self._network, parameters=True)
                self._wrapped = self._network
            else:
                # DDP (and the gradient average it reserves) only once training needs it:
                # evaluate/predict-only runs never build it.
                self._wrapped = self._strategy._wrap_network(
                    self._network, self.device, self._optimizer, AMP_DTYPES.get(self._amp)
                )
            self._stepper = None
        if self._stepper is None:
            networks = [self._network if self._wrapped is None else self._wrapped, self._network]
            if self._compile:
                # torch.compile's import of torch.utils.mkldnn warns.
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", ".*script_method", DeprecationWarning)
                    networks = [torch.compile(network) for network in networks]
            self._stepper = Stepper(self, *networks)
        return self._stepper

    def summary(
        self, input_size: Any = None, dtype: Any = None, input: Any = None
    ) -> dict[str, int]:
        """Print the network's layers and parameter counts (Paddle's ``Model.summary``).

        A quick check that the network is the one you meant before paying for
        training. With example inputs the table also shows each layer's input
        and output shapes, read from one forward pass (eval mode, no
        gradients, on zeros; each module's mode is restored). Under several
        processes every process computes it and the main process prints it.

        Args:
            input_size: example input shapes, read as Paddle reads them: an int
                ``n`` is the shape ``(n,)``; a tuple such as ``(1, 1, 28, 28)``
                is one input (``-1``/``None`` for the batch dimension reads as
                1; no other dimension may be unknown); a list of shapes gives
                one input each; nested tuples give nested inputs, e.g.
                ``[(-1, 23, 16), ((2, -1, 32), (2, -1, 32))]`` for an LSTM's
                ``x, (h0, c0)``. ``None``: counts only, no shapes.
            dtype: the inputs' ``torch.dtype`` or its name (default float32),
                one for all inputs or a list with one per input.
            input: actual tensors instead of ``input_size`` (a tensor, or a
                list or dict of them, passed to the network as its one
                argument, as in Paddle).

        Returns:
            ``{"total_params": int, "trainable_params": int}``; every parameter
            is counted once, whether or not the example forward pass uses it.

        Raises:
            TypeError: ``input_size`` holds something that is no size, or ``dtype`` is unknown.
            ValueError: a shape has more than one ``-1``/``None`` or a size below 1, or both
                ``input_size`` and ``input`` were given.
        """
        with _printed_by_main_process():
            return summarize(self._network, input_size, dtype, self.device, input)

    def flops(
        self,
        input_size: Any = None,
        custom_ops: dict[type, Any] | None = None,
        print_detail: bool = False,
        *,
        input: Any = None,
    ) -> int:
        """The network's FLOPs on one forward pass: :func:`hapi.flops` on ``model.network``.

        The example inputs are made on the model's device. Under several
        processes every process counts and the main process prints.

        Args:
            input_size: the example input's shape with its batch dimension,
                e.g. ``(1, 1, 28, 28)``, or any form :meth:`summary` accepts.
            custom_ops: ``{ModuleType: fn(module, inputs, output)}`` for module
                types with no built-in count (or to replace one).
            print_detail: also print each layer's shapes, parameters and FLOPs.
            input: instead of ``input_size``, the actual input (a tensor, or a
                list or dict of them).

        Returns:
            The total FLOPs (multiply-adds counted once), an int.

        Raises:
            TypeError: ``custom_ops``/``input_size`` are malformed.
            ValueError: no input was given, or a shape has more than one
                unknown dimension.
        """
        with _printed_by_main_process():
            return count_flops(
                self._network, input_size, custom_ops, print_detail, input=input, device=self.device
            )

    def _loader(self, source: Any, role: str, batch_size: int, workers: int, **options: Any) -> Any:
        options.update(role=role, batch_size=batch_size, num_workers=workers, device=self.device)
        return data.make_loader(source, **options)

    def _callbacks(
        self, given: Any, loader: Any, verbose: int, batch_size: int, log_freq: int, **params: Any
    ) -> CallbackList:
        """The run's callbacks (the user's and the defaults), their model and params set: the
        run's own ``params`` (fit's settings, ``save_dir``, ...) over these defaults."""
        save = {"save_dir": params.pop("save_dir", None), "save_freq": params.pop("save_freq", 1)}
        cbks = callbacks_for_run(self, given, verbose=verbose, log_freq=log_freq, **save)
        if save["save_dir"] is not None:
            params["save_dir"] = save["save_dir"]  # EarlyStopping's best_model goes there
        run = {"rank": distributed.rank(), "world_size": distributed.world_size(), "epochs": None}
        run.update(metrics=self._metrics.names() if self._metrics else [], verbose=verbose)
        run.update(batch_size=data.loader_batch_size(loader) or batch_size, log_freq=log_freq)
        cbks.set_params({**run, "steps": data.num_batches(loader), **params})
        return cbks

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
        self._stepper_for("fit")
        settings = dict(epochs=epochs, eval_steps=eval_steps, num_iters=num_iters)
        settings["accumulate_grad_batches"] = accumulate_grad_batches
        counts = dict(settings, eval_freq=eval_freq, log_freq=log_freq, save_freq=save_freq)
        for name, value in counts.items():
            require_int("fit", name, value, allow_none=name in ("num_iters", "eval_steps"))
        _check_verbose(verbose)
        if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
            raise TypeError(
                "resume_from must be the path of a checkpoint saved during fit; received "
                f"{type(resume_from).__name__}."
            )
        if accumulate_grad_batches != 1 and self._overrides("train_step"):
            raise ValueError(
                f"fit(accumulate_grad_batches={accumulate_grad_batches}) with a train_step of your "
                f"own ({type(self).__name__}), which decides when to update: accumulate in it."
            )
        train_size, eval_size = data.batch_sizes(batch_size)
        train_source = data.as_source(train_data, "train_data")  # refused before anything is drawn
        eval_source = data.as_source(eval_data, "eval_data")
        streams_for_training()  # after seed_everything: each process its own stream from here
        data_seed = data.fit_seed(train_source, shuffle)
        options = dict(shuffle=shuffle, drop_last=drop_last, seed=data_seed)
        loader = self._loader(train_source, "train_data", train_size, num_workers, **options)
        eval_loader = None
        if eval_source is not None:
            eval_loader = self._loader(eval_source, "eval_data", eval_size, num_workers)
        per_epoch = data.num_batches(loader)
        if num_iters is not None and per_epoch:
            settings["epochs"] = math.ceil(num_iters / per_epoch)
        params = dict(settings, steps=_limit(per_epoch, num_iters), save_dir=save_dir)
        params["save_freq"] = save_freq
        cbks = self._callbacks(callbacks, loader, verbose, train_size, log_freq, **params)
        self.stop_training = False
        self.epoch = self.epoch_step = 0
        train = data.TrainData(loader, train_data, data_seed)
        inexact = train.inexact_reason()
        if inexact and (resume_from is not None or any(getattr(c, "resumable", 0) for c in cbks)):
            warn(
                "This fit writes or reads checkpoints to resume from, but a resumed epoch will "
                f"not equal the uninterrupted one: {inexact}.",
            )
        self._fit_run = run = _FitRun(cbks, train, eval_loader, eval_freq, log_freq, **settings)
        try:
            fit_loop(self, run, restore=lambda: run_state.restore_fit(self, resume_from))
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
        self._stepper_for("evaluate")
        require_int("evaluate", "log_freq", log_freq)
        require_int("evaluate", "num_iters", num_iters, allow_none=True)
        _check_verbose(verbose)
        loader = self._loader(eval_data, "eval_data", batch_size, num_workers)
        with _params_kept(callbacks):
            cbks = self._callbacks(callbacks, loader, verbose, batch_size, log_freq)
            return evaluate_loop(self, loader, cbks, log_freq=log_freq, num_iters=num_iters)

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
        self._stepper_for("predict")
        _check_verbose(verbose)
        loader = self._loader(test_data, "test_data", batch_size, num_workers)
        with _params_kept(callbacks):
            cbks = self._callbacks(callbacks, loader, verbose, batch_size, DEFAULT_LOG_FREQ)
            outputs = predict_loop(self, loader, cbks)
        if not stack_outputs:
            return outputs
        return [torch.cat(b) if b and torch.is_tensor(b[0]) else b for b in outputs]

    # -- files: hapi.state collects and restores, hapi.checkpoint writes and reads -------
    @property
    def sharded(self) -> bool:
        """Whether each process holds only a shard of the weights (FSDP on several processes).

        A callback that saves often reads it to choose ``save(..., sharded=True)``
        (``BackupAndRestore`` does), which spares gathering the whole model.
        """
        return self._strategy._shards_weights

    def save(
        self,
        path: str | os.PathLike,
        training: bool = True,
        resumable: bool = False,
        sharded: bool = False,
        wait: bool = True,
    ) -> str:
        """Write a checkpoint, atomically: a crash never leaves a half-written file.

        Every process must call it (it is collective); only the main process
        writes, so never put it under ``if is_main``. What is written is what
        every process evaluates.

        Args:
            path: the file to write; ``.pt`` is added unless it ends in ``.pt``
                or ``.pth``.
            training: ``True``: the network, optimizer(s), gradient scaler,
                epoch/step counters and RNG states, to continue training;
                ``False``: only the network's weights, for inference, as the
                network's plain ``state_dict`` (full tensors under every
                strategy), which ``net.load_state_dict(torch.load(path,
                weights_only=True))`` reads with no torch-hapi, and
                :meth:`load` too.
            resumable: during ``fit``, also what ``load(..., resume=True)``
                needs to continue that fit exactly (each process's RNG states
                and running figures, the data order, every callback's
                ``state_dict``); ``BackupAndRestore`` saves this way.
            sharded: write a directory ``path`` through torch's distributed
                checkpoint (DCP) instead: every process writes the shards it
                holds, in parallel (the directory must be one that every
                process sees, as on a shared file system); :meth:`load` reads
                it on any number of processes, under any strategy.
            wait: ``False`` returns as soon as the state is copied to CPU
                memory; the file is written in the background and replaces the
                previous one only once complete. The next save or load,
                :meth:`wait_for_saves` and the end of the script wait for it,
                Ctrl-C included (the interrupt is delivered once the file is
                whole). The CPU copy is reused by the next background save.

        Returns:
            The file written (``path`` + ``.pt``), or the directory when
            ``sharded``.

        Raises:
            ValueError: ``sharded=True`` with several optimizers.
            hapi.checkpoint.CheckpointError: the state holds an object the
                safe loader would refuse (the message names the entry), or the
                file could not be written, now or in the background (a full or
                read-only disk: also an ``OSError`` with its ``errno``); the
                previous file is left as it was.
        """
        return run_state.save(self, path, training, resumable, sharded, wait)

    def wait_for_saves(self) -> None:
        """Return once every ``save(..., wait=False)`` is on disk; raise if one failed.

        Call it before reading a background-saved file from elsewhere, or to
        learn of a failed write early. Every process must call it (it is
        collective, like ``save``). It also frees the CPU copy of the state
        that background saves keep for reuse.

        Raises:
            hapi.checkpoint.CheckpointError: a background write failed.
        """
        checkpoint.wait_for_writes()
        checkpoint.release_staging()

    def load(
        self,
        path: str | os.PathLike,
        skip_mismatch: bool = False,
        reset_optimizer: bool = False,
        resume: bool = False,
    ) -> None:
        """Restore a checkpoint written by :meth:`save` (or a plain ``state_dict`` file).

        Loading never runs code from the file (``weights_only``), and a
        network of another architecture is refused with the keys that differ.
        The optimizer's per-parameter state (momentum, Adam's moments, step
        counts) is restored, now or at the next ``prepare``; its settings
        (``lr``, ``betas``, ``weight_decay``, ...) stay those of the optimizer
        given to ``prepare``, whichever came first, and a warning names any
        the file had otherwise. The epoch and step counters are restored. Every
        process calls it; a sharded directory loads on any number of processes.

        Args:
            path: the file (``.pt`` may be left out) or sharded directory.
            skip_mismatch: load only tensors whose names and shapes match,
                warning about the rest, instead of raising (fine-tuning a
                network whose head changed).
            reset_optimizer: leave the optimizer's current state as it is.
            resume: also restore what continuing an interrupted ``fit`` needs
                -- RNG states, the data order and position in the epoch, the
                running figures, the optimizer's settings (a schedule may have
                changed them) and every callback's state -- from a file saved
                with ``resumable=True``. Only while ``fit`` restores an
                interrupted run, before its first batch (``fit(resume_from=)``
                and ``callbacks.BackupAndRestore.restore_backup`` call it), on
                every process: each gets the copy furthest into training among
                the machines, so no shared file system is needed, even when a
                restart gives rank 0 to another machine.

        Raises:
            FileNotFoundError: no file at ``path`` / ``path.pt`` (with
                ``resume``: on no machine; raised on every process).
            hapi.checkpoint.CheckpointError: the file is damaged, carries code,
                or belongs to another architecture (the error names the keys).
        """
        run_state.load(self, path, skip_mismatch, reset_optimizer, resume)

    def export(
        self, path: str | os.PathLike, example_inputs: Any, dynamic_batch: bool = True
    ) -> str:
        """Write the network for inference through ``torch.export``, to run with no torch-hapi.

        ``torch.export.load(path).module()`` runs it anywhere torch runs: no
        Python class of yours and no torch-hapi needed. The network is exported
        in eval mode. Every process calls it; rank 0 writes. Under FSDP on
        several processes every process first gathers the full weights and
        rank 0 exports a plain copy of the network holding them; the copy costs
        rank 0 the memory of the whole model once, as ``save`` does.

        Args:
            path: the file to write; ``.pt2`` is added when missing.
            example_inputs: an input the network accepts (a tensor, or a tuple
                of them for several inputs), used to trace it.
            dynamic_batch: let the exported program take any batch size, not
                only the example's.

        Returns:
            The file written (``path`` + ``.pt2``).

        Raises:
            RuntimeError: rank 0 could not export (its error says why).
        """
        from hapi.export import export_network, export_path  # torch.export only when exporting

        network = self._strategy._inference_network(self._network)  # a collective under FSDP
        distributed.on_main(  # every process calls it, rank 0 writes (like save)
            lambda: export_network(network(), path, example_inputs, dynamic_batch=dynamic_batch),
            lambda: RuntimeError(
                f"Rank 0 could not export to {export_path(path)!r}; see its error."
            ),
        )
        return export_path(path)

    # -- one batch, Paddle style --------------------------------------------------
    def train_batch(self, inputs: Any, labels: Any = None, update: bool = True) -> dict[str, float]:
        """One training step on one batch, Paddle-style, for loops of your own.

        Args:
            inputs: the network's input(s), as Paddle takes them: a tensor or
                NumPy array, or a list of them, one per argument of the
                network's ``forward``. Nothing is split off: pass the labels
                apart.
            labels: the label(s) for the loss and metrics (a tensor, or a
                list of them), or ``None`` for a loss computed from the
                outputs alone.
            update: step the optimizer. With ``update=False`` the gradients
                accumulate until a later call updates.

        Returns:
            This batch's figures, ``{"loss": float, <metric name>: float}``
            (this process's batch alone, not a running mean).

        Raises:
            RuntimeError: ``prepare`` was not called or gave no optimizer.
        """
        return self._one_batch("train_batch", inputs, labels, update)

    def eval_batch(self, inputs: Any, labels: Any = None) -> dict[str, float]:
        """Evaluate one batch, with no gradients and the network in eval mode.

        Args:
            inputs: the network's input(s), as :meth:`train_batch` takes them.
            labels: the label(s) for the loss and metrics, or ``None``.

        Returns:
            This batch's figures, ``{"loss": float, <metric name>: float}``.

        Raises:
            RuntimeError: ``prepare`` was not called.
        """
        return self._one_batch("eval_batch", inputs, labels)

    def predict_batch(self, inputs: Any) -> list[torch.Tensor]:
        """The network's outputs for one batch of inputs (eval mode, no gradients).

        Args:
            inputs: the network's input(s), as :meth:`train_batch` takes them
                (a list passes each element to the network: leave labels out).

        Returns:
            A list with one CPU tensor per network output.
        """
        stepper = self._stepper_for("predict")
        stepper.network.eval()
        inputs_, _ = self._splitter.user_batch(inputs, None)
        return [o.cpu() for o in stepper.predict(inputs_)]

    def _one_batch(
        self, purpose: str, inputs: Any, labels: Any, update: bool = True
    ) -> dict[str, float]:
        """``train_batch`` (``update`` given) or ``eval_batch``: the figures of this batch alone
        (Paddle keeps running ones; one batch is clearer)."""
        stepper = self._stepper_for(purpose)
        training = purpose == "train_batch"
        stepper.network.train(training)
        inputs, labels = self._splitter.user_batch(inputs, labels)
        if not training:
            loss, outputs = stepper.evaluate(inputs, labels)
        else:
            loss, outputs = stepper.train(inputs, labels, update)
            stepper.end_step()
            self.step += int(update)
        if not labels:
            return {} if loss is None else {"loss": loss.item()}
        self._metrics.reset()
        self._metrics.use_metrics = True
        self._metrics.update(loss, outputs, labels, batch_length(outputs, labels))
        return self._metrics.compute(sync=False)  # this process's batch: no collective

    def _overrides(self, name: str) -> bool:
        return getattr(type(self), name) is not getattr(Model, name)

    # -- the steps: built in, or your own (Keras' train_step, Lightning's training_step) ----
    def train_step(self, batch: Any) -> dict[str, Any] | None:
        """One training batch: the built-in step, or yours in a subclass (Keras' ``train_step``).

        The built-in step splits the batch into inputs and labels, runs the
        network under ``amp``'s autocast, computes the loss, back-propagates
        (scaled over ``accumulate_grad_batches``) and, when the batch ends an
        accumulation group, updates the optimizer (callbacks'
        ``on_before_optimizer_step``, clipping); it updates the loss and
        ``prepare``'s metrics itself and returns ``None``.

        Override it for what the built-in step cannot express: a GAN's two optimizers,
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
        inputs, labels = self._splitter.split(batch)
        loss, outputs = self._stepper.train(inputs, labels, *self._stepper.accumulation)
        self._update_metrics(loss, outputs, labels, inputs)

    def eval_step(self, batch: Any) -> dict[str, Any] | None:
        """One evaluation batch (``evaluate`` and ``fit``'s evaluations): built in, or yours.

        Runs under ``torch.no_grad()`` with the network in eval mode. The
        built-in step scores the batch with the loss and ``prepare``'s metrics
        and returns ``None``; override it for figures they cannot give.

        Args:
            batch: the loader's batch on the model's device, as the data gives it.

        Returns:
            The figures of this batch, e.g. ``{"loss": ..., "bleu": ...}``;
            their means over the whole data (across processes too) are what
            ``evaluate`` returns.
        """
        inputs, labels = self._splitter.split(batch)
        loss, outputs = self._stepper.evaluate(inputs, labels)
        self._update_metrics(loss, outputs, labels, inputs)

    def predict_step(self, batch: Any) -> Any:
        """One prediction batch (``predict``): the network's outputs on its inputs, or yours.

        Runs under ``torch.no_grad()`` with the network in eval mode. The
        built-in step drops the batch's labels and returns the network's
        outputs; override it to decode, post-process or return other outputs.

        Args:
            batch: the loader's batch on the model's device, as the data gives it.

        Returns:
            A tensor, or a list/tuple of tensors (one per output), whose first
            dimension is the batch; ``predict`` collects them in data-set order.
        """
        inputs, _ = self._splitter.split(batch, need_labels=False)
        return self._stepper.predict(inputs)

    def _update_metrics(
        self, loss: torch.Tensor | None, outputs: list, labels: list, inputs: list
    ) -> None:
        """The built-in steps' running loss and metrics (and per-output losses) on one batch."""
        size = batch_length(inputs, labels)
        self._metrics.use_metrics = True  # also when an override calls the built-in step
        self._metrics.update(loss, outputs, labels, size)
        if loss is not None and self._stepper.loss_parts:
            self._metrics.add_logs(self._stepper.loss_parts, size)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` inside a :meth:`train_step` of your own.

        Use it rather than ``loss.backward()`` so that ``amp="fp16"`` scales the
        loss as the built-in step does (it is the plain call otherwise).

        Args:
            loss: a scalar tensor to back-propagate.
        """
        self._stepper_for("train_step").backward(loss)

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
                f"optimizer_step() got {type(chosen).__name__}, not one of the optimizers given to "
                f"prepare() ({sorted(self._optimizers)}); pass one of self.optimizers."
            )
        self._stepper_for("train_step").update(chosen, average=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The ``amp`` autocast context ``prepare`` chose, for the forward of your own steps.

        Returns:
            A context manager: ``with self.autocast(): out = self.network(x)``;
            a no-op without ``amp``.
        """
        return self._stepper_for("train_step").autocast()


@contextlib.contextmanager
def _params_kept(callbacks: Any) -> Iterator[None]:
    """The given callbacks' ``params`` back as they were after an evaluation or a prediction:
    one run from a fit's callback, with the fit's own callbacks, leaves them knowing that a
    fit is under way (``epochs`` set)."""
    given = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks]
    kept = [(c, c.params) for c in given if isinstance(c, Callback) and c.params]
    try:
        yield
    finally:
        for callback, params in kept:
            callback.params = params


# Keras' names for what Model does under another name.
_KERAS_NAMES = {
    "compile": "prepare(optimizer, loss, metrics), e.g. model.prepare("
    "torch.optim.Adam(model.parameters()), torch.nn.CrossEntropyLoss())",
    "train_on_batch": "train_batch(inputs, labels)",
    "test_on_batch": "eval_batch(inputs, labels)",
    "predict_on_batch": "predict_batch(inputs)",
    "save_weights": "save(path, training=False)",
    "load_weights": "load(path)",
}


def _check_trains_network(optimizers: dict[str, Any], network: nn.Module, loss: Any) -> None:
    """Refuse an optimizer that holds none of the parameters fit computes gradients for.

    Built over another module (``SGD(other.parameters())``), it would step
    nothing: the loss would stay flat, silently. One over a part of the
    network is fine-tuning, as in Keras (frozen layers) and Lightning (an
    optimizer over a subset): the rest keeps its values. A loss module's own
    parameters count as trained too.
    """
    modules = [network, loss] if isinstance(loss, nn.Module) else [network]
    trained = {id(p) for module in modules for p in module.parameters()}
    for name, optimizer in optimizers.items():
        held, kind = optimized_parameters(optimizer), type(optimizer).__name__
        if not any(id(p) in trained for p in held):
            which = f"optimizer {name!r}" if len(optimizers) > 1 else "the optimizer"
            raise ValueError(
                f"prepare(): {which} ({kind}) holds {len(held)} parameters, none of them among the "
                f"{len(trained)} of the network ({type(network).__name__}) or the loss, so fit "
                f"would train nothing. Build it over the model's: {kind}(model.parameters(), ...), "
                "or over the part to fine-tune, e.g. model.network.<layer>.parameters()."
            )


def _printed_by_main_process() -> contextlib.AbstractContextManager:
    """A table printed once per job, not once per process (the counts are the same on each)."""
    return contextlib.redirect_stdout(sys.stdout if distributed.is_main() else io.StringIO())


# -- the loops ----------------------------------------------------------------------
def _stop_check(can_stop: bool, steps: int | None, log_freq: int) -> Callable | None:
    """``stop(step, flag)``: whether a pass stops after batch ``step`` because a callback set
    ``flag`` (``model.stop_training`` / ``stop_evaluating`` / ``stop_predicting``), the same
    answer on every process; ``None`` when nothing can stop the pass (no callback with a
    batch hook anywhere): then no process asks, per batch or otherwise.

    One process: after every batch (a Python flag, no cost). Several (a collective here):
    the flag is agreed (one all-reduce) every ``log_freq`` batches, and only among the
    first ``steps`` batches, which every process has and none ends with (an evaluation's
    shards may differ by a batch, and its last batch reduces the logs: any other
    collective there would pair with the wrong one; training passes ``math.inf``, as
    every process runs the same steps). Where a length is unknown (iterable data to
    evaluate or predict) each process reads its own flag: no collective, so none can hang.
    """
    if distributed.world_size() > 1:
        facts = distributed.gather_objects((bool(can_stop), steps))
        can_stop = any(wants for wants, _ in facts)
        lengths = [length for _, length in facts]
        if can_stop and None not in lengths:
            before = min(lengths)
            return lambda step, flag: (
                (step + 1) % log_freq == 0 and step + 1 < before and distributed.any_true(flag)
            )
    return (lambda step, flag: bool(flag)) if can_stop else None


def _limit(steps: int | None, num_iters: int | None) -> int | None:
    """The smaller of two lengths, either of which may be unknown (``None``)."""
    return min([n for n in (steps, num_iters) if n is not None], default=None)


def _batch_logs(batch_size: int, logs: dict[str, float] | None, metrics: Any) -> dict:
    """``batch_size``; with logs, also ``samples``, the count they cover."""
    read = {} if logs is None else {"samples": metrics.counted, **logs}
    return {"batch_size": batch_size, **read}


def _accumulation(step: int, is_last: bool, every: int, steps: int | None) -> tuple[bool, float]:
    """Whether this batch updates the weights, and its share of the group's loss.

    A group of ``every`` batches is averaged (loss / group size), so that
    ``every`` batches of b train like one batch of ``every``*b. The epoch's last
    group may be shorter; when the epoch length is known it is averaged over
    its true size.
    """
    if every == 1:
        return True, 1.0
    group_start = step - step % every
    group_size = every if steps is None else min(every, steps - group_start)
    return (step + 1) % every == 0 or is_last, 1.0 / group_size


def fit_loop(model: Any, run: _FitRun, restore: Callable[[], None]) -> dict[str, float]:
    """Train ``run.epochs`` epochs (fewer when stopped); returns the last epoch's logs.

    ``restore`` puts an interrupted fit's state back (a resume) after ``on_train_begin``,
    which may reset what it restores, and before the loop reads the counters."""
    logs: dict[str, float] = {}
    cbks = run.callbacks
    if not model._overrides("train_step") and model._stepper.nothing_trainable():
        warn(
            f"fit(): no parameter of {distributed.class_name(model._network)} requires a gradient, "
            "so nothing will be updated: the loss and metrics are reported, the weights stay (as "
            "Keras trains a model with trainable=False). Set requires_grad=True on those to train.",
        )
    model._optimizer.zero_grad(set_to_none=True)  # nothing left from a stopped accumulation
    cbks.on_train_begin()
    restore()  # model.epoch / model.epoch_step: where the loop starts
    # The training batches num_iters still allows in this fit (None: no cap).
    left = run.num_iters
    if left is not None:
        left -= model.epoch * (run.train_data.steps_per_epoch or 0) + model.epoch_step
    for epoch in range(model.epoch, run.epochs):
        cbks.on_epoch_begin(epoch)
        batches = run.train_data.epoch(epoch)  # after the callbacks: what they draw comes first
        evaluates = run.eval_loader is not None and epoch % run.eval_freq == 0
        stop_step = None if left is None else model.epoch_step + left
        logs = _train_epoch(model, run, batches, stop_step, evaluates)
        left = None if left is None else stop_step - model.epoch_step
        if evaluates:
            logs.update({f"val_{k}": v for k, v in _evaluate_in_fit(model, run).items()})
        model.epoch, model.epoch_step = epoch + 1, 0
        cbks.on_epoch_end(epoch, logs)
        if distributed.any_true(model.stop_training) or left == 0:
            break
    cbks.on_train_end(logs)
    return logs


def _evaluate_in_fit(model: Any, run: _FitRun) -> dict[str, float]:
    """An evaluation during fit (each ``eval_steps`` optimizer steps, or the epoch's): one
    model's statistics everywhere, and the training logs set aside meanwhile, so that
    they carry on after it and a save made during it keeps them."""
    with model._metrics.set_aside():
        logs = evaluate_loop(model, run.eval_loader, run.callbacks, log_freq=run.log_freq)
    model._stepper.network.train()
    return logs


def _train_epoch(
    model: Any, run: _FitRun, loader: Iterable, stop_step: int | None, evaluates: bool
) -> dict[str, float]:
    """One epoch's batches from ``loader``, which starts at batch ``model.epoch_step``
    (non-zero when resuming mid-epoch), to ``stop_step`` (``num_iters``' end) or the epoch's
    end. Every ``eval_steps`` optimizer steps an evaluation follows the update, before
    ``on_train_batch_end``, so that callbacks there see the step with its evaluation; not
    at the epoch's last batch when the epoch ``evaluates`` at its end anyway."""
    stepper, metrics, splitter = model._stepper, model._metrics, model._splitter
    cbks, log_freq, first_step = run.callbacks, run.log_freq, model.epoch_step
    steps = _limit(run.train_data.steps, stop_step)
    eval_steps = run.eval_steps if run.eval_loader is not None else None
    notify_begin = cbks.wants("on_train_batch_begin")
    notify_end = cbks.wants("on_train_batch_end")
    # Two collectives run mid-epoch only for batch callbacks: reading the logs
    # (for on_train_batch_end) and agreeing on a stop request (only a batch
    # callback can make one mid-epoch). Every process must run them alike, also
    # when a script gives a batch callback to one process only.
    read_logs = distributed.any_true(notify_end)
    stop_check = _stop_check(notify_begin or notify_end, math.inf, log_freq)
    stepper.network.train()
    metrics.use_metrics = not model._overrides("train_step")
    if first_step == 0:
        metrics.reset()  # a resumed epoch keeps the running logs restored with it
    logs: dict[str, float] | None = None  # the last logs read, if read after the last batch
    length = None if steps is None else max(steps - first_step, 0)  # left of this epoch
    for step, (batch, is_last) in enumerate(data.with_last(loader, length), start=first_step):
        if notify_begin:
            cbks.on_train_batch_begin(step)
        stepper.accumulation = _accumulation(step, is_last, run.accumulate_grad_batches, steps)
        update = stepper.accumulation[0]
        batch = splitter.to_device(batch)
        _step_logs(model.train_step(batch), "train_step", metrics, splitter, batch)
        stepper.end_step()
        model.step += int(update)
        model.epoch_step = step + 1
        # Every process runs the same number of training steps, so logs read
        # here can be reduced across processes, and a stop request agreed on.
        # Nobody listening (verbose=0, no batch callback): both wait for the end.
        due = is_last or (step + 1) % log_freq == 0
        logs = _train_logs(stepper, metrics) if due and (read_logs or is_last) else None
        if update and eval_steps and model.step % eval_steps == 0 and not (is_last and evaluates):
            _evaluate_in_fit(model, run)
        if notify_end:
            cbks.on_train_batch_end(step, _batch_logs(splitter.length(batch), logs, metrics))
        if is_last or (stop_check is not None and stop_check(step, model.stop_training)):
            break
    return logs if logs is not None else _train_logs(stepper, metrics)


def _train_logs(stepper: Any, metrics: Any) -> dict[str, float]:
    """The running logs, and ``grad_norm`` (the last update's, before clipping) when clipping."""
    logs = metrics.compute()
    if stepper.grad_norm is not None:
        logs["grad_norm"] = float(stepper.grad_norm)
    return logs


def _step_logs(returned: Any, step_name: str, metrics: Any, splitter: Any, batch: Any) -> None:
    """Log what a step of the user's own returned (the built-in steps update the metrics
    themselves and return ``None``)."""
    if returned is None:
        return
    if not isinstance(returned, dict):
        raise TypeError(
            f"{step_name} must return a dict of the values to log, e.g. {{'loss': loss}}; "
            f"received {type(returned).__name__}."
        )
    metrics.update_logs(returned, splitter.length(batch))


def evaluate_loop(
    model: Any, loader: Iterable, cbks: CallbackList, *, log_freq: int, num_iters: int | None = None
) -> dict[str, float]:
    """One pass over evaluation data; returns the logs over all of it (over the batches
    seen, when a callback set ``model.stop_evaluating``)."""
    stepper, metrics, splitter = model._stepper, model._metrics, model._splitter
    # Every process scores the main process's model (its buffers; its weights too where
    # DDP never aligned them): see hapi.distributed.sync_from_main.
    distributed.sync_from_main(model._network, parameters=model._wrapped is None)
    notify_begin = cbks.wants("on_eval_batch_begin")
    steps = _limit(data.exact_length(loader), num_iters)
    model.stop_evaluating = False  # as Keras: each evaluation starts afresh
    stop_check = _stop_check(notify_begin or cbks.wants("on_eval_batch_end"), steps, log_freq)
    cbks.on_eval_begin(
        {"steps": _limit(data.num_batches(loader), num_iters), "metrics": metrics.names()}
    )
    stepper.network.eval()
    metrics.reset()
    metrics.use_metrics = not model._overrides("eval_step")
    logs: dict[str, float] | None = None
    # Shards may differ by a batch: no collective per batch.
    # Inside, every process holds the full weights: evaluation batches need no collective.
    with model._strategy._gathered(stepper.eval_network), torch.no_grad():
        for step, (batch, is_last) in enumerate(data.with_last(loader, steps)):
            if notify_begin:
                cbks.on_eval_batch_begin(step)
            batch = splitter.to_device(batch)
            _step_logs(model.eval_step(batch), "eval_step", metrics, splitter, batch)
            # Running logs stay local, and only the last batch's are reduced
            # (each process has one).
            due = is_last or (step + 1) % log_freq == 0
            logs = metrics.compute(sync=is_last, agree=True) if due else None
            cbks.on_eval_batch_end(step, _batch_logs(splitter.length(batch), logs, metrics))
            if is_last:
                break
            if stop_check is not None and stop_check(step, model.stop_evaluating):
                logs = None  # the logs so far, over every process (one collective)
                break
    results = logs if logs is not None else metrics.compute(agree=True)
    cbks.on_eval_end(results)
    return results


def predict_loop(model: Any, loader: Iterable, cbks: CallbackList) -> list[list[torch.Tensor]]:
    """The network's outputs over the data, per output a list of CPU batches (those seen,
    when a callback set ``model.stop_predicting``)."""
    stepper, splitter = model._stepper, model._splitter
    # Every process scores the main process's model (its buffers; its weights too where
    # DDP never aligned them): see hapi.distributed.sync_from_main.
    distributed.sync_from_main(model._network, parameters=model._wrapped is None)
    notify_begin = cbks.wants("on_predict_batch_begin")
    model.stop_predicting = False
    can_stop = notify_begin or cbks.wants("on_predict_batch_end")
    stop_check = _stop_check(can_stop, data.exact_length(loader), DEFAULT_LOG_FREQ)
    cbks.on_predict_begin({"steps": data.num_batches(loader)})
    stepper.network.eval()
    per_output: list[list[torch.Tensor]] = []
    # Inside, every process holds the full weights: evaluation batches need no collective.
    with model._strategy._gathered(stepper.eval_network), torch.no_grad():
        for step, batch in enumerate(loader):
            if notify_begin:
                cbks.on_predict_batch_begin(step)
            batch = splitter.to_device(batch)
            outputs = as_list(model.predict_step(batch))
            if not per_output:
                per_output = [[] for _ in outputs]
            for store, output in zip(per_output, outputs):
                store.append(output.cpu() if torch.is_tensor(output) else output)
            cbks.on_predict_batch_end(step, {"batch_size": splitter.length(batch)})
            if stop_check is not None and stop_check(step, model.stop_predicting):
                break
    cbks.on_predict_end()
    return distributed.gather_in_order(per_output)
