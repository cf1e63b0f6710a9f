"""``hapi.Model``: the public API. Holds the network and what ``prepare`` chose.

Its other parts: ``fit``/``evaluate``/``predict`` in :mod:`hapi.model_runs`,
files in :mod:`hapi.model_io`, a step of your own in :mod:`hapi.own_steps`. The
loop bodies live in :mod:`hapi.loops`, one batch in :mod:`hapi.steps`,
processes and devices in :mod:`hapi.distributed`, files in
:mod:`hapi.checkpoint`.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
from torch import nn

from hapi import distributed
from hapi.amp import AMP_DTYPES, make_scaler, parse_amp
from hapi.batches import BatchSplitter
from hapi.flop_count import count_flops
from hapi.loops import Parts
from hapi.metrics import MetricSet, normalise_metrics
from hapi.model_io import ModelFiles
from hapi.model_runs import DEFAULT_BATCH_SIZE, DEFAULT_LOG_FREQ, ModelRuns, _FitRun  # noqa: F401
from hapi.own_steps import OwnSteps, named_optimizers
from hapi.steps import Stepper, check_clipping, check_loss
from hapi.summary import summarize


class Model(ModelRuns, OwnSteps, ModelFiles):
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
        # Keras 3: a callback sets these in on_eval_batch_end / on_predict_batch_end to end
        # evaluate / predict after that batch; each evaluation and prediction resets them.
        self.stop_evaluating = False
        self.stop_predicting = False
        self.epoch = 0  # epochs completed in the current fit (restored by load)
        self.epoch_step = 0  # batches done in the epoch in progress (restored by load)
        self.step = 0  # optimizer steps taken, over the model's life (restored by load)
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

    def get_weights(self) -> dict[str, torch.Tensor]:
        """The network's weights as full, plain CPU tensors, whatever the strategy (Keras' name).

        A copy that later training leaves as it is: what ``EarlyStopping``
        keeps of the best epoch, or an average of weights. Whole even under
        FSDP, where each process holds a shard of each parameter (the shards
        are gathered: every process must call it then), and the same on every
        process. ``torch.save(model.get_weights(), path)`` writes a plain
        ``state_dict`` that the network loads with no torch-hapi.

        Returns:
            The network's ``state_dict`` keys (no ``module.`` prefix) mapped to
            CPU tensors.
        """
        return {
            key: value.detach().to("cpu", copy=True)
            for key, value in distributed.full_state_dict(self._network).items()
        }

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
                f"{' '.join(str(error).split()).rstrip('.')}. Pass what get_weights() returned "
                "for this network."
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
                trained on several processes (build a new Model instead).
        """
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
                f"{self._strategy!r}: the network is already wrapped for that strategy. Build a new "
                "Model(network) to train with another strategy."
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
        self._splitter.labels_to_network = (
            loss is None
        )  # dict batches: the network computes its loss
        self._scaler = make_scaler(amp_setting, self.device)
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
    trained = {id(p) for p in network.parameters()}
    if isinstance(loss, nn.Module):
        trained |= {id(p) for p in loss.parameters()}
    for name, optimizer in optimizers.items():
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if not any(id(p) in trained for p in held):
            which = f"optimizer {name!r}" if len(optimizers) > 1 else "the optimizer"
            raise ValueError(
                f"prepare(): {which} ({type(optimizer).__name__}) holds {len(held)} parameters, "
                f"none of them among the {len(trained)} of the network "
                f"({type(network).__name__}) or the loss, so fit would train nothing. Build "
                f"it over the model's: {type(optimizer).__name__}(model.parameters(), ...), or "
                "over the part to fine-tune, e.g. model.network.<layer>.parameters()."
            )


@contextlib.contextmanager
def _printed_by_main_process() -> Iterator[None]:
    """A table printed once per job, not once per process (the counts are the same on each)."""
    if distributed.is_main():
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield
