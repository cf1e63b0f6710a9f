"""Metrics: :class:`Accuracy` for scripts; names, the running loss and torchmetrics state for the loop.

A script uses ``hapi.metrics.Accuracy`` (Paddle's top-k accuracy) or any
torchmetrics metric; the rest of this module (``MetricSet``) serves the loop.

During an epoch nothing here reads a value back to the host: the loss is
summed into a device tensor and torchmetrics accumulate their own states.
:meth:`MetricSet.compute` is the one place values become Python floats, and
the loop calls it only every ``log_freq`` steps and at the end of a pass.
Figures are means over every sample seen since :meth:`MetricSet.reset`, not
the last batch's.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import warnings
from typing import Any, Iterator

import torch

from hapi import distributed
from hapi.data import describe

# MetricSet and normalise_metrics serve Model and the loops; a user script needs only Accuracy.
__all__ = ["Accuracy"]  # noqa: F822 (Accuracy: module __getattr__, on first use)


def __getattr__(name: str) -> Any:
    # torchmetrics costs ~0.7 s at import (more where it finds transformers or matplotlib):
    # it loads when a script uses hapi.metrics.Accuracy or brings a torchmetrics metric.
    if name == "Accuracy":
        from hapi.accuracy import Accuracy

        return Accuracy
    raise AttributeError(f"module 'hapi.metrics' has no attribute {name!r}")


def _metric_types() -> tuple[type, ...]:
    """torchmetrics' Metric and MetricCollection, or nothing when no metric was ever made.

    torchmetrics is read from ``sys.modules``, never imported here: a metric object exists
    only once its module was imported. A MetricCollection is not a Metric subclass, but it
    behaves as one whose compute() returns a dict.
    """
    torchmetrics = sys.modules.get("torchmetrics")
    return () if torchmetrics is None else (torchmetrics.Metric, torchmetrics.MetricCollection)


def _is_collection(metric: Any) -> bool:
    return isinstance(metric, _metric_types()[1:])


def _is_accuracy(metric: Any) -> bool:
    return isinstance(metric, getattr(sys.modules.get("hapi.accuracy"), "Accuracy", ()))


def _check_metric(metric: Any, where: str) -> Any:
    if isinstance(metric, _metric_types()):  # isinstance(x, ()) is False: no metric ever made
        return metric
    if isinstance(metric, type) and issubclass(metric, _metric_types()):
        raise TypeError(
            f"metrics{where} is the class {metric.__name__}, not an instance; "
            f"write {metric.__name__}(...) with its arguments."
        )
    raise TypeError(
        f"metrics{where} must be a torchmetrics.Metric; received {metric!r} of type "
        f"{type(metric).__name__}. Use e.g. hapi.metrics.Accuracy(), or wrap a plain function "
        "in a torchmetrics.Metric subclass."
    )


def normalise_metrics(metrics: Any) -> dict[str, Any]:
    """``prepare(metrics=...)`` → ``{name: metric}`` with stable, documented names.

    A dict keeps its keys; otherwise a metric is named by its ``names()``
    (hapi's Accuracy) or its class name in snake_case
    (``MulticlassAccuracy`` → ``multiclass_accuracy``), with ``_2``, ``_3``
    added to repeated names.
    """
    if metrics is None:
        return {}
    several = isinstance(metrics, (list, tuple))
    nested = (list, tuple, dict, type(None))
    if metrics and several and all(isinstance(m, nested) for m in metrics):
        # One list per output (Keras' multi-output form): metrics[i] sees output i and label i.
        named = {}
        for position, of_output in enumerate(metrics):
            for name, metric in normalise_metrics(of_output).items():
                metric._hapi_output = position  # noqa: SLF001 -- read by MetricSet.update
                named[f"output_{position}_{name}"] = metric
        return named
    if isinstance(metrics, dict):
        for key in metrics:
            if not isinstance(key, str) or not key:
                raise TypeError(f"metric names must be non-empty strings; received key {key!r}.")
        return {key: _check_metric(metric, f"[{key!r}]") for key, metric in metrics.items()}
    named = {}
    for index, metric in enumerate(metrics if several else [metrics]):
        _check_metric(metric, f"[{index}]" if several else "")
        base = metric.name if _is_accuracy(metric) else _snake_case(type(metric).__name__)
        name, n = base, 1
        while name in named:
            n += 1
            name = f"{base}_{n}"
        named[name] = metric
    return named


def _snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


class MetricSet:
    """The running loss and the metrics of one pass, on one device."""

    def __init__(self, metrics: dict[str, Any], with_loss: bool) -> None:
        self.metrics = metrics
        self.with_loss = with_loss
        self.device = torch.device("cpu")  # where the sums live: the model's (see to())
        self.reset()
        # False while a user's step runs the pass: it hands back figures, not the
        # outputs and labels the metrics need (set by the loop, alike on every process).
        self.use_metrics = True
        self.counted = 0  # samples the last compute() covered (all processes' with sync)
        self._set_aside: dict[str, Any] | None = None  # training sums while an evaluation runs
        # torchmetrics gathers states across ranks whenever compute() runs in a
        # process group; we decide when (see distributed.SyncFlag) and never
        # want a cached, possibly local, value back.
        self._sync = distributed.SyncFlag()
        for metric in _leaves(self.metrics):
            metric.distributed_available_fn = self._sync
            metric.compute_with_cache = False

    def to(self, device: torch.device) -> "MetricSet":
        self.device = torch.device(device)
        for metric in self.metrics.values():
            metric.to(device)
        return self

    def names(self) -> list[str]:
        """The logged names, ``"loss"`` first (known before any data is seen)."""
        names = (["loss"] if self.with_loss else []) + sorted(self._log_sums.keys() - {"loss"})
        for key, metric in self.metrics.items() if self.use_metrics else ():
            if _is_accuracy(metric):
                names += [key + name[len(metric.name) :] for name in metric.names()]
            else:
                names += list(metric.keys(keep_base=False)) if _is_collection(metric) else [key]
        return names

    @contextlib.contextmanager
    def set_aside(self) -> Iterator[None]:
        """Run an evaluation inside a training pass: the training figures come back after it,
        and :meth:`training_state_dict` answers with them meanwhile (a resumable save made
        during that evaluation must hold the training figures, not the evaluation's)."""
        self._set_aside, use_metrics = self.state_dict(), self.use_metrics
        try:
            yield
        finally:
            self.load_state_dict(self._set_aside)
            self._set_aside, self.use_metrics = None, use_metrics

    def training_state_dict(self) -> dict[str, Any]:
        """The training pass's running sums, also while an evaluation has set them aside."""
        return self.state_dict() if self._set_aside is None else self._set_aside

    def state_dict(self) -> dict[str, Any]:
        """A copy of the running sums of the pass in progress (for a resume mid-epoch): the
        pass goes on adding to its own tensors."""
        on_cpu = functools.partial(_moved, device="cpu", copy=True)
        figures = {name: on_cpu(total) for name, total in self._log_sums.items()}
        return {
            "loss_sum": figures.pop("loss", None),
            "samples": self._samples,
            # None while no step returned a weight: the weights are then the sample count.
            "weight_sum": on_cpu(self._weight_sum) if torch.is_tensor(self._weight_sum) else None,
            "figures": figures,
            "metrics": [
                {name: on_cpu(value) for name, value in metric.metric_state.items()}
                for metric in _leaves(self.metrics)
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._samples = int(state["samples"])
        weight_sum = state.get("weight_sum")
        self._weight_sum = self._samples if weight_sum is None else weight_sum.to(self.device)
        figures = {name: total.to(self.device) for name, total in state.get("figures", {}).items()}
        loss_sum = _moved(state["loss_sum"], self.device)
        self._log_sums = figures if loss_sum is None else {"loss": loss_sum, **figures}
        for metric, saved in zip(_leaves(self.metrics), state["metrics"]):
            for name, value in saved.items():
                setattr(metric, name, _moved(value, self.device))

    def reset(self) -> None:
        self._samples = 0
        # The loss and the figures a step of the user's own returns (``train_step``/
        # ``eval_step``): sums weighted by batch size.
        self._log_sums: dict[str, torch.Tensor] = {}
        # What the figures were weighted by: the sample count, or the sum of the
        # ``"weight"`` a step returned (tokens, say), a tensor on its device from then on.
        self._weight_sum: int | torch.Tensor = 0
        for metric in self.metrics.values():
            metric.reset()

    @torch.no_grad()
    def update(
        self,
        loss: torch.Tensor | None,
        outputs: list[torch.Tensor],
        labels: list[torch.Tensor],
        batch_size: int,
    ) -> None:
        """Accumulate one batch; ``metric.update(*outputs, *labels)`` (under no_grad).

        A metric of output ``i`` (``prepare(metrics=[[...], [...]])``) gets output ``i`` and
        label ``i`` only.
        """
        self.update_logs({} if loss is None else {"loss": loss}, batch_size)
        for key, metric in self.metrics.items():
            position = getattr(metric, "_hapi_output", None)
            ours = slice(None) if position is None else slice(position, position + 1)
            try:
                metric.update(*outputs[ours], *labels[ours])
            except TypeError as error:
                of = "" if position is None else f" is for output {position}, and"
                raise TypeError(
                    f"The metric {key!r} ({type(metric).__name__}){of} failed on outputs "
                    f"{describe(outputs[ours])} and labels {describe(labels[ours])} of a batch of "
                    f"{len(outputs)} outputs and {len(labels)} labels: {error}. A metric is called "
                    "as update(*outputs, *labels); with several outputs, give metrics per output: "
                    "prepare(metrics=[[metrics of output 0], [metrics of output 1], ...])."
                ) from error

    @torch.no_grad()
    def update_logs(self, figures: dict[str, Any], batch_size: int) -> None:
        """Accumulate one batch of a user's step: ``loss`` and any other named scalars.

        A ``"weight"`` entry (not logged) weighs this batch's figures instead of
        ``batch_size``: a language model returns its token count, so that the
        pass's figures are per token (the sum of value * weight over the sum of
        the weights, over every process).
        """
        weight = batch_size
        if "weight" in figures:  # a tensor weight stays on its device: no read back per batch
            figures = dict(figures)  # the step's own dict keeps its "weight"
            value = figures.pop("weight")
            weight = torch.as_tensor(value).detach()
            if weight.numel() != 1 or weight.is_complex() or weight.dtype == torch.bool:
                raise ValueError(
                    "A step's 'weight' must be one number (e.g. the batch's token count); "
                    f"received {describe([value])}."
                )
            if weight.device.type == "cpu" and float(weight) < 0:
                raise ValueError(
                    f"A step's 'weight' must not be negative; received {float(weight)}. Return "
                    "the count its figures are averaged over (samples, tokens)."
                )
            weight = weight.reshape(()).double()
        self._weight_sum = self._weight_sum + weight
        self.add_logs(figures, weight)
        self._samples += batch_size

    @torch.no_grad()
    def add_logs(self, figures: dict[str, Any], batch_size: int | torch.Tensor) -> None:
        """Named scalars of a batch already counted by :meth:`update` (each output's loss, say),
        weighted by ``batch_size``: a count, or a scalar tensor (a step's ``"weight"``).

        ``total += value * weight`` in place, on the value's device: no host sync per batch.
        The loss sums in float32 and sets ``with_loss`` (a network or a user's step may bring
        a loss although ``prepare`` got none); other figures sum in float64.
        """
        for name, value in figures.items():
            value = torch.as_tensor(value).detach()
            if value.numel() != 1:
                raise ValueError(
                    f"{name!r} has {value.numel()} elements where one number is logged; return "
                    "one-element figures from train_step/eval_step and a loss reduced to one number."
                )
            self.with_loss = self.with_loss or name == "loss"
            dtype = torch.float32 if name == "loss" else torch.float64
            total = self._log_sums.get(name)
            if total is None:  # the first batch: no tensor made per batch after it
                total = self._log_sums[name] = value.new_zeros((), dtype=dtype)
            weight = batch_size.to(total.device) if torch.is_tensor(batch_size) else batch_size
            total.add_(value.reshape(()).to(dtype) * weight)

    def compute(self, sync: bool = True, agree: bool = False) -> dict[str, float]:
        """Means over every sample since :meth:`reset`.

        With ``sync`` (a collective: every process must call it) the figures
        cover every process's samples; without, only this process's. With
        ``agree`` (an evaluation's end) the processes first agree on the logged
        names: a process whose shard was empty saw none of them.
        """
        if sync and agree and distributed.world_size() > 1:
            agreed = distributed.gather_objects((sorted(self._log_sums), self.with_loss))
            for name in {name for names, _ in agreed for name in names} - self._log_sums.keys():
                self._log_sums[name] = torch.zeros((), dtype=torch.float64)
            self.with_loss = any(with_loss for _, with_loss in agreed)
        # As many sums on every process: in training the same step code logs the same names,
        # and an evaluation's end agrees on them (above). The loss comes first, in a slot of
        # its own.
        names = sorted(name for name in self._log_sums if name != "loss")
        loss = self._log_sums.get("loss", 0.0)
        sums = (self._samples, self._weight_sum, loss, *(self._log_sums[name] for name in names))
        totals = torch.stack([torch.as_tensor(v, dtype=torch.float64).cpu() for v in sums])
        if sync:
            totals = distributed.all_reduce_sum(totals)
        self.counted = int(totals[0].item())
        if self.counted == 0:
            return {}
        means = (totals[2:] / totals[1]).tolist()  # per sample, or per unit of a step's weight
        results = {"loss": means[0]} if self.with_loss else {}
        results.update(zip(names, means[1:]))
        if not self.use_metrics:
            return results
        self._sync.enabled = sync
        try:
            with warnings.catch_warnings():
                # A rank whose shard was empty still joins the gather; torchmetrics
                # warns that it computes before any update.
                warnings.filterwarnings("ignore", message=".*before the ``update`` method.*")
                values = {key: metric.compute() for key, metric in self.metrics.items()}
        finally:
            self._sync.enabled = False
        for key, value in values.items():
            metric = self.metrics[key]
            for sub, sub_value in value.items() if isinstance(value, dict) else [(key, value)]:
                name = key + sub[len(metric.name) :] if _is_accuracy(metric) else sub
                if name in results:
                    raise ValueError(
                        f"Two metrics log the name {name!r} (the second from metrics[{key!r}]); "
                        "give them distinct names with a dict, or a prefix on the MetricCollection."
                    )
                if torch.is_tensor(sub_value) and sub_value.numel() != 1:
                    raise ValueError(
                        f"metric {name!r} computed a tensor of shape {tuple(sub_value.shape)}, where "
                        "a scalar is logged; use average='micro' or 'macro', not average=None."
                    )
                results[name] = float(sub_value)
        return results


def _moved(value: Any, device: Any, copy: bool = False) -> Any:
    """A running sum or a metric state (a tensor, a list of them, or None) on ``device``."""
    if value is None or torch.is_tensor(value):
        return value if value is None else value.to(device, copy=copy)
    return [v.to(device, copy=copy) for v in value]


def _leaves(metrics: Any) -> list[Any]:
    """The Metric objects of a ``{name: metric}`` dict, looking inside MetricCollections."""
    return [leaf for m in metrics.values() for leaf in (_leaves(m) if _is_collection(m) else [m])]
