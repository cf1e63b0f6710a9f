"""The training, evaluation and prediction loops: every hook call, every logs dict.

Read top to bottom, ``fit_loop`` is the whole of training::

    on_train_begin
    restore an interrupted fit's state (resume_from, BackupAndRestore)
    for epoch in range(model.epoch, epochs):
        on_epoch_begin(epoch)
        for each batch:  on_train_batch_begin / train step / on_train_batch_end
        every eval_steps optimizer steps (mid-epoch, when asked): an evaluation
        every eval_freq epochs (epoch % eval_freq == 0, as in Paddle):
            on_eval_begin / on_eval_batch_* / on_eval_end
        on_epoch_end(epoch, train logs + val_ logs)
        stop when any process set model.stop_training (checked at the epoch end,
        and every log_freq steps when a batch callback could set it; after every
        batch on one process, where asking costs nothing), or num_iters is reached
    on_train_end

``evaluate_loop`` and ``predict_loop`` end early, after a batch, when a callback sets
``model.stop_evaluating`` / ``model.stop_predicting`` (Keras 3; see :class:`_StopCheck`).

Figures reach the host only every ``log_freq`` steps and at the end of a pass
(:meth:`MetricSet.compute`); nothing here depends on which process runs it
(that is :mod:`hapi.distributed`'s job).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from hapi import distributed
from hapi.callbacks import CallbackList
from hapi.data import exact_length, num_batches, with_last
from hapi.steps import as_list
from hapi.train_data import TrainData


@dataclass
class _Budget:
    """The training batches ``num_iters`` still allows in this fit (``None``: no cap): one count."""

    left: int | None

    def stop_step(self, first_step: int) -> int | None:
        """The batch of an epoch starting at ``first_step`` where the budget runs out (if in it)."""
        return None if self.left is None else first_step + self.left

    def spend(self, batches: int) -> None:
        if self.left is not None:
            self.left -= batches

    @property
    def spent(self) -> bool:
        return self.left == 0


@dataclass
class _StopCheck:
    """Where an evaluation or a prediction asks whether a callback set
    ``model.stop_evaluating`` / ``model.stop_predicting``, so that every process stops after
    the same batch.

    One process: after every batch (a Python flag, no cost). Several: the
    flag is agreed (one all-reduce) every ``every`` batches (``log_freq``), as
    ``stop_training`` is, and only among the first ``before`` batches, which
    every process has and none ends with (an evaluation's shards may differ by
    a batch, and its last batch reduces the logs: any other collective
    there would pair with the wrong one). Where a length is unknown (iterable
    data) each process reads its own flag: no collective, so none can hang.
    """

    every: int
    before: int | None = None
    local: bool = True

    @classmethod
    def for_pass(cls, can_stop: bool, steps: int | None, log_freq: int) -> "_StopCheck | None":
        """``None`` when nothing can stop the pass (no callback with a batch hook anywhere):
        then no process asks, per batch or otherwise. A collective on several processes."""
        if distributed.world_size() == 1:
            return cls(1) if can_stop else None
        facts = distributed.gather_objects((bool(can_stop), steps))
        if not any(wants for wants, _ in facts):
            return None
        lengths = [length for _, length in facts]
        if any(length is None for length in lengths):
            return cls(1)
        return cls(log_freq, min(lengths), local=False)

    def __call__(self, step: int, flag: bool) -> bool:
        """Whether the pass stops after batch ``step`` (the same answer on every process)."""
        if (step + 1) % self.every or (self.before is not None and step + 1 >= self.before):
            return False
        return bool(flag) if self.local else distributed.any_true(flag)


def _limit(steps: int | None, num_iters: int | None) -> int | None:
    if num_iters is None:
        return steps
    return num_iters if steps is None else min(steps, num_iters)


def _logs_due(step: int, is_last: bool, log_freq: int) -> bool:
    return is_last or (step + 1) % log_freq == 0


def _batch_logs(batch_size: int, logs: dict[str, float] | None, metrics: Any) -> dict:
    """``batch_size``; with logs, also ``samples``, the count they cover."""
    if logs is None:
        return {"batch_size": batch_size}
    return {"batch_size": batch_size, "samples": metrics.counted, **logs}


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


def fit_loop(
    model: Any,
    train_data: TrainData,
    eval_loader: Iterable | None,
    cbks: CallbackList,
    *,
    epochs: int,
    eval_freq: int,
    log_freq: int,
    accumulate_grad_batches: int,
    num_iters: int | None,
    eval_steps: int | None = None,
    restore: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Train ``epochs`` epochs (fewer when stopped); returns the last epoch's logs.

    ``restore`` puts an interrupted fit's state back (a resume) after ``on_train_begin``,
    which may reset what it restores, and before the loop reads the counters."""
    logs: dict[str, float] = {}
    stepper = model._stepper
    if not model._overrides("train_step") and stepper.nothing_trainable():
        warnings.warn(
            f"fit(): no parameter of {distributed.class_name(stepper.eval_network)} "
            "requires a gradient (every one has requires_grad=False), so nothing will be "
            "updated: the loss and metrics are computed and reported, the weights stay as "
            "they are (as Keras trains a model with trainable=False). Set requires_grad=True "
            "on the parameters to train, and give them to the optimizer.",
            stacklevel=3,
        )
    stepper.optimizer.zero_grad(set_to_none=True)  # nothing left from a stopped accumulation
    cbks.on_train_begin()
    restore()  # model.epoch / model.epoch_step: where the loop starts
    budget = _Budget(
        None
        if num_iters is None
        else num_iters - model.epoch * (train_data.steps_per_epoch or 0) - model.epoch_step
    )
    for epoch in range(model.epoch, epochs):
        cbks.on_epoch_begin(epoch)
        batches = train_data.epoch(epoch)  # after the callbacks: what they draw comes first
        ends_with_evaluation = eval_loader is not None and epoch % eval_freq == 0

        def evaluate_after_update(is_last: bool) -> None:
            # Every eval_steps optimizer steps; not twice in a row at the epoch's end.
            if model.step % eval_steps == 0 and not (is_last and ends_with_evaluation):
                _evaluate_in_fit(model, eval_loader, cbks, log_freq)

        logs, batches_done = _train_epoch(
            model,
            batches,
            train_data.steps,
            cbks,
            log_freq=log_freq,
            accumulate=accumulate_grad_batches,
            first_step=model.epoch_step,
            stop_step=budget.stop_step(model.epoch_step),
            after_update=None
            if eval_loader is None or eval_steps is None
            else evaluate_after_update,
        )
        if ends_with_evaluation:
            val_logs = _evaluate_in_fit(model, eval_loader, cbks, log_freq)
            logs.update({f"val_{name}": value for name, value in val_logs.items()})
        model.epoch, model.epoch_step = epoch + 1, 0
        cbks.on_epoch_end(epoch, logs)
        budget.spend(batches_done)
        if distributed.any_true(model.stop_training) or budget.spent:
            break
    cbks.on_train_end(logs)
    return logs


def _evaluate_in_fit(
    model: Any, loader: Iterable, cbks: CallbackList, log_freq: int
) -> dict[str, float]:
    """An evaluation during fit (each ``eval_steps`` optimizer steps, or the epoch's): one
    model's statistics everywhere, and the training logs set aside meanwhile, so that
    they carry on after it and a save made during it keeps them."""
    distributed.sync_from_main(model._stepper.eval_network)
    with model._metrics.set_aside():
        logs = evaluate_loop(model, loader, cbks, log_freq=log_freq, num_iters=None)
    model._stepper.network.train()
    return logs


def _train_epoch(
    model: Any,
    loader: Iterable,
    epoch_steps: int | None,
    cbks: CallbackList,
    *,
    log_freq: int,
    accumulate: int,
    first_step: int,
    stop_step: int | None,
    after_update: Callable[[bool], None] | None = None,
) -> tuple[dict[str, float], int]:
    """One epoch's batches from ``loader``, which starts at batch ``first_step`` (non-zero when
    resuming mid-epoch), to ``stop_step`` (``num_iters``' end) or the epoch's end
    (``epoch_steps`` batches, when known); ``after_update(is_last)`` follows each update,
    before ``on_train_batch_end``, so that callbacks there see the step with its evaluation."""
    stepper, metrics, splitter = model._stepper, model._metrics, model._splitter
    steps = _limit(epoch_steps, stop_step)
    notify_begin = cbks.wants("on_train_batch_begin")
    notify_end = cbks.wants("on_train_batch_end")
    # Two collectives run mid-epoch only for batch callbacks: reading the logs
    # (for on_train_batch_end) and agreeing on a stop request (only a batch
    # callback can make one mid-epoch). Every process must run them alike, also
    # when a script gives a batch callback to one process only.
    read_logs = distributed.any_true(notify_end)
    check_stop = distributed.any_true(notify_begin or notify_end)
    single_process = distributed.world_size() == 1  # asking after every batch costs nothing
    stepper.network.train()
    metrics.use_metrics = not model._overrides("train_step")
    if first_step == 0:
        metrics.reset()  # a resumed epoch keeps the running logs restored with it
    done = 0
    logs: dict[str, float] | None = None  # the last logs read, if read after the last batch
    for step, (batch, is_last) in enumerate(
        with_last(loader, None if steps is None else max(steps - first_step, 0)), start=first_step
    ):
        is_last = is_last or step + 1 == stop_step
        if notify_begin:
            cbks.on_train_batch_begin(step)
        stepper.accumulation = _accumulation(step, is_last, accumulate, steps)
        update = stepper.accumulation[0]
        batch = splitter.to_device(batch)
        batch_size = _step_logs(model.train_step(batch), "train_step", metrics, splitter, batch)
        stepper.end_step()
        model.step += int(update)
        model.epoch_step = step + 1
        done = step + 1 - first_step
        # Every process runs the same number of training steps, so logs read
        # here can be reduced across processes, and a stop request agreed on.
        # Nobody listening (verbose=0, no batch callback): both wait for the end.
        due = _logs_due(step, is_last, log_freq)
        logs = _train_logs(stepper, metrics) if due and (read_logs or is_last) else None
        if after_update is not None and update:
            after_update(is_last)
        if notify_end:
            cbks.on_train_batch_end(step, _batch_logs(batch_size, logs, metrics))
        if is_last or (
            check_stop and (due or single_process) and distributed.any_true(model.stop_training)
        ):
            break
    return (logs if logs is not None else _train_logs(stepper, metrics)), done


def _train_logs(stepper: Any, metrics: Any) -> dict[str, float]:
    """The running logs, and ``grad_norm`` (the last update's, before clipping) when clipping."""
    logs = metrics.compute()
    if stepper.grad_norm is not None:
        logs["grad_norm"] = float(stepper.grad_norm)
    return logs


def _step_logs(returned: Any, step_name: str, metrics: Any, splitter: Any, batch: Any) -> int:
    """Log what a step of the user's own returned (the built-in steps update the metrics
    themselves and return ``None``); the batch's sample count."""
    batch_size = splitter.length(batch)
    if returned is None:
        return batch_size
    if not isinstance(returned, dict):
        raise TypeError(
            f"{step_name} must return a dict of the values to log, e.g. {{'loss': loss}}; "
            f"received {type(returned).__name__}."
        )
    metrics.update_logs(returned, batch_size)
    return batch_size


def evaluate_loop(
    model: Any,
    loader: Iterable,
    cbks: CallbackList,
    *,
    log_freq: int,
    num_iters: int | None,
) -> dict[str, float]:
    """One pass over evaluation data; returns the logs over all of it (over the batches
    seen, when a callback set ``model.stop_evaluating``)."""
    stepper, metrics, splitter = model._stepper, model._metrics, model._splitter
    notify_begin = cbks.wants("on_eval_batch_begin")
    steps = exact_length(loader)
    model.stop_evaluating = False  # as Keras: each evaluation starts afresh
    stop_check = _StopCheck.for_pass(
        notify_begin or cbks.wants("on_eval_batch_end"), _limit(steps, num_iters), log_freq
    )
    stopped = False
    cbks.on_eval_begin(
        {"steps": _limit(num_batches(loader), num_iters), "metrics": metrics.names()}
    )
    stepper.network.eval()
    metrics.reset()
    metrics.use_metrics = not model._overrides("eval_step")
    logs: dict[str, float] | None = None
    # Shards may differ by a batch: no collective per batch.
    with stepper.gathered(), torch.no_grad():
        for step, (batch, is_last) in enumerate(with_last(loader, _limit(steps, num_iters))):
            is_last = is_last or step + 1 == num_iters
            if notify_begin:
                cbks.on_eval_batch_begin(step)
            batch = splitter.to_device(batch)
            batch_size = _step_logs(model.eval_step(batch), "eval_step", metrics, splitter, batch)
            # Running logs stay local, and only the last batch's are reduced
            # (each process has one).
            logs = metrics.compute(sync=is_last) if _logs_due(step, is_last, log_freq) else None
            cbks.on_eval_batch_end(step, _batch_logs(batch_size, logs, metrics))
            if is_last:
                break
            if stop_check is not None and stop_check(step, model.stop_evaluating):
                stopped = True  # the logs so far, over every process (one collective)
                break
    results = logs if logs is not None and not stopped else metrics.compute()
    cbks.on_eval_end(results)
    return results


def predict_loop(
    model: Any, loader: Iterable, cbks: CallbackList, *, log_freq: int = 10
) -> list[list[torch.Tensor]]:
    """The network's outputs over the data, per output a list of CPU batches (those seen,
    when a callback set ``model.stop_predicting``)."""
    stepper, splitter = model._stepper, model._splitter
    notify_begin = cbks.wants("on_predict_batch_begin")
    model.stop_predicting = False
    stop_check = _StopCheck.for_pass(
        notify_begin or cbks.wants("on_predict_batch_end"), exact_length(loader), log_freq
    )
    cbks.on_predict_begin({"steps": num_batches(loader)})
    stepper.network.eval()
    per_output: list[list[torch.Tensor]] = []
    with stepper.gathered(), torch.no_grad():
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
