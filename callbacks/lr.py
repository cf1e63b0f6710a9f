"""Learning-rate callbacks: LRScheduler (drives a torch scheduler) and
ReduceLROnPlateau (Keras' plateau rule, on the logged figures).

Both act on ``model.optimizer`` only through the public torch API
(``scheduler.step()``, ``optimizer.param_groups``), so they work the same for
any optimizer and on every rank: the logs are already reduced across ranks,
so all ranks change the learning rate identically.
"""

from __future__ import annotations

import math
import warnings
from numbers import Real
from typing import Any, Callable

import torch
from torch.optim import lr_scheduler as torch_lr
from tqdm import tqdm

from .base import Callback
from .monitor import MonitorCallback, refuse_state, require_int, require_number

SchedulerFactory = Callable[[torch.optim.Optimizer, int], torch_lr.LRScheduler]


def _check_scheduler(scheduler: Any, received: str) -> None:
    if isinstance(scheduler, torch_lr.ReduceLROnPlateau):
        raise TypeError(
            f"LRScheduler cannot drive torch's ReduceLROnPlateau, whose step() needs the monitored "
            f"figure; {received} one. Use callbacks.ReduceLROnPlateau(monitor='val_loss', ...)."
        )
    if not isinstance(scheduler, torch_lr.LRScheduler):
        # A class is callable, yet no factory: StepLR(optimizer, total) would take total for its
        # step_size.
        kind = "the class" if isinstance(scheduler, type) else "an object of type"
        name = scheduler.__name__ if isinstance(scheduler, type) else type(scheduler).__name__
        raise TypeError(
            "LRScheduler needs a torch.optim.lr_scheduler.LRScheduler instance or a function "
            f"(optimizer, total) -> scheduler; {received} {kind} {name}. Pass e.g. LRScheduler("
            "StepLR(optimizer, step_size=10)) or LRScheduler(lambda optimizer, total: ...)."
        )


class LRScheduler(Callback):
    """Steps a ``torch.optim.lr_scheduler`` once per epoch, or once per optimizer step.

    Args:
        scheduler: a ``torch.optim.lr_scheduler.LRScheduler`` built on the
            model's optimizer (``StepLR``, ``CosineAnnealingLR``, ``OneCycleLR``...),
            or a factory ``(optimizer, total) -> scheduler`` that this callback
            calls at the start of every ``fit`` with ``model.optimizer`` and
            the length of that fit in scheduler steps: per step, the number of
            optimizer updates this process will make,
            ``epochs * ceil(steps / accumulate_grad_batches)`` (``steps`` being
            this process's batches per epoch, so the schedule fits any number
            of processes); per epoch, the number of epochs. A schedule sized
            by hand from ``len(loader)`` of the whole data set would run only
            half its course on two processes.
        by_step: True steps after every optimizer step, as ``OneCycleLR``
            needs; with gradient accumulation that is once per
            ``accumulate_grad_batches`` batches, because the callback follows
            ``model.step`` (the count of optimizer steps), not the batch index.
            False steps at each epoch end. Unset (None) means False --
            PyTorch's convention for ``StepLR`` and its kin, whose arguments
            (``step_size``, ``T_max``, ``milestones``) count epochs -- unless
            ``by_epoch=False`` asks for steps.
        by_epoch: Paddle's keyword, the other switch: True steps at each epoch
            end, False after every optimizer step. Paddle's
            ``LRScheduler(by_step=True, by_epoch=False)`` and
            ``LRScheduler(by_step=False, by_epoch=True)`` mean the same here.

    Raises:
        ValueError: ``by_step`` and ``by_epoch`` both True (the scheduler would
            step twice as fast) or both False (it would never step).

    A factory-made scheduler is stepped ``total - 1`` times, never after the
    fit's last update: the learning rate left in the optimizer at the end is
    the one the last update used (for ``OneCycleLR``, its end value; one more
    step would carry it past its end).

    A resumed fit (``fit(resume_from=...)``, ``BackupAndRestore``) makes a
    factory's scheduler anew for its own total and steps it to where the
    checkpoint left it -- on another number of processes, to the same fraction
    of its course -- so the schedule still ends with the fit's last update. A
    scheduler given ready-made takes its saved ``state_dict``; a saved state of
    another kind of scheduler, or with a count out of range, is refused.

    Attributes:
        scheduler: the scheduler driven (with a factory: None until ``fit``
            starts, then the one made for the current fit).
        by_step: True when the scheduler steps per optimizer step, False per
            epoch (``by_step`` and ``by_epoch`` resolved).
        total: the length the factory was called with in the current fit, or
            None for a scheduler given ready-made.
    """

    def __init__(
        self,
        scheduler: torch_lr.LRScheduler | SchedulerFactory,
        by_step: bool | None = None,
        by_epoch: bool | None = None,
    ) -> None:
        super().__init__()
        made = isinstance(scheduler, (torch_lr.LRScheduler, type)) or not callable(scheduler)
        if made:
            _check_scheduler(scheduler, "received")
        self._factory: SchedulerFactory | None = None if made else scheduler
        self.scheduler: torch_lr.LRScheduler | None = scheduler if made else None
        if None not in (by_step, by_epoch) and bool(by_step) == bool(by_epoch):
            raise ValueError(
                f"LRScheduler received by_step={bool(by_step)} and by_epoch={bool(by_epoch)}: the "
                f"scheduler would step {'both per step and per epoch' if by_step else 'never'}. "
                "Pass one of them: by_step=True (per optimizer step) or by_epoch=True (per epoch)."
            )
        self.by_step = bool(by_step) if by_epoch is None else not by_epoch  # Paddle's or ours
        if not self.by_step:  # per-epoch: no per-batch call (callbacks.base)
            self.unused_hooks = ("on_train_batch_end",)
        self.total: int | None = None
        self._per_epoch = 1
        self._stepped = 0  # scheduler steps taken since the factory made it
        self._last_step: int | None = None
        self._pending: dict[str, Any] | None = None  # a state loaded before the scheduler exists
        self._start: list[dict[str, Any]] = []  # the optimizer's settings before the factory
        self._touched: set[str] = set()  # those the factory's schedule sets

    def _fit_length(self) -> int:
        """This fit's length in scheduler steps: epochs, or this process's optimizer updates."""
        epochs, steps = self.params.get("epochs"), self.params.get("steps")
        if not isinstance(epochs, int) or epochs < 1:
            raise RuntimeError(
                f"LRScheduler needs the number of epochs to size its schedule; params has "
                f"epochs={epochs!r}. A scheduler factory works only inside fit()."
            )
        self._per_epoch = 1  # updates per epoch: what a resume on another world size changes
        if not self.by_step:
            return epochs
        if steps is None:
            raise ValueError(
                "LRScheduler(factory, by_step=True) sizes its schedule from the batches per epoch: "
                "received steps=None (a loader without len()). Give fit() num_iters=..., or pass "
                "a scheduler of explicit length, e.g. OneCycleLR(..., total_steps=N)."
            )
        every = self.params.get("accumulate_grad_batches", 1)
        self._per_epoch = math.ceil(steps / every)
        # num_iters batches in all: whole epochs of `steps`, then a shorter last one.
        num_iters = self.params.get("num_iters")
        whole, rest = (epochs, 0) if num_iters is None else divmod(num_iters, steps)
        return whole * self._per_epoch + math.ceil(rest / every)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._factory is not None:
            groups = self.model.optimizer.param_groups
            self.total = self._fit_length()
            self._start = [
                {k: v.clone() if torch.is_tensor(v) else v for k, v in g.items()} for g in groups
            ]
            if self._pending is not None:  # resumed already: the optimizer holds a scheduled rate
                for start in self._start:
                    start["lr"] = start.get("initial_lr", start["lr"])
            self._build(0)
            self._touched = {"lr"} | {  # the settings the schedule sets (or adds)
                k for g0, g1 in zip(self._start, groups) for k in g1 if g0.get(k) is not g1[k]
            }
        # Only optimizer steps taken from here on move the schedule.
        self._last_step = self.model.step
        if self._pending is not None:
            self.load_state_dict(self._pending)

    def _build(self, position: int) -> None:
        """A scheduler from the factory, for this fit's total, brought to ``position`` steps.

        Stepping replays the schedule as the run that reached ``position``
        made it, from the optimizer's settings before the factory, so a
        resumed fit's rates are the uninterrupted one's, and a fit of another
        length (another number of processes) continues at the same point of
        its course.
        """
        for group, start in zip(self.model.optimizer.param_groups, self._start):
            for key in self._touched - start.keys():
                group.pop(key, None)
            for key in self._touched & start.keys():  # a tensor setting stays that tensor
                group[key] = (
                    group[key].copy_(start[key]) if torch.is_tensor(group[key]) else start[key]
                )
        scheduler = self._factory(self.model.optimizer, self.total)
        _check_scheduler(scheduler, "the factory returned")
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": a replay
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(position):
                scheduler.step()
        self.scheduler, self._stepped = scheduler, position

    def state_dict(self) -> dict[str, Any]:
        return {
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "last_step": self._last_step,
            "stepped": self._stepped,
            "total": self.total,
            "per_epoch": self._per_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the schedule; with a factory, once ``on_train_begin`` has made the scheduler.

        A resume (``BackupAndRestore``) loads after every other callback's
        ``on_train_begin``, so the factory has made this fit's scheduler by then;
        a state loaded earlier waits for it. A factory's schedule is made anew
        for this fit's total and stepped to where the state left it (on another
        number of processes, to the same epoch and fraction of it); a scheduler
        given ready-made takes the saved ``state_dict``.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            ValueError: a value that no run could have saved (a wrong type, a
                negative count, a step beyond the schedule's total, a
                ``last_step`` that does not fit the model's step, a scheduler
                state of another kind); the error names the entry and the value.
        """
        if self.scheduler is None:
            self._pending = state
            return
        self._pending = None
        last_step = _count(state, "last_step", none=True)
        step = getattr(self.model, "step", None)
        if self.by_step and None not in (last_step, step) and not 0 <= step - last_step <= 1:
            expected = f"the model's optimizer step {step} or one less"
            refuse_state("LRScheduler", "last_step", last_step, expected)
        if self._factory is not None:
            stepped = _count(state, "stepped")
            total = _count(state, "total", none=True) or self.total
            if stepped >= max(total, 1):
                refuse_state("LRScheduler", "stepped", stepped, f"below the total of {total} steps")
            # Another number of processes changes the updates per epoch: the same point of the
            # course is the same epoch and fraction of it. Another `epochs` changes nothing.
            per_epoch = _count(state, "per_epoch", none=True) or self._per_epoch
            position = round(stepped * self._per_epoch / per_epoch)
            self._build(min(position, max(self.total - 1, 0)))
        elif state.get("scheduler") is not None:
            # Keys only one of them has are let be, as torch's load_state_dict does: a release
            # of torch adds or drops a private attribute now and then.
            saved, current = state["scheduler"], self.scheduler.state_dict()
            if not isinstance(saved, dict) or any(
                _layout(saved[key]) != _layout(value)
                for key, value in current.items()
                if key in saved and None not in (saved[key], value)
            ):
                expected = f"the state of a scheduler like this one, {current!r}"
                refuse_state("LRScheduler", "scheduler", saved, expected)
            self.scheduler.load_state_dict(saved)
        if last_step is not None:
            self._last_step = last_step

    def _step(self) -> None:
        if self.total is not None and self._stepped >= self.total - 1:
            return  # the fit's last update is done: nothing will use a further rate
        self.scheduler.step()
        self._stepped += 1

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        if not self.by_step:
            return
        current = self.model.step
        for _ in range(0 if self._last_step is None else current - self._last_step):
            self._step()  # none when the step went back (a new fit without on_train_begin)
        self._last_step = current

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not self.by_step:
            self._step()


def _count(state: dict[str, Any], key: str, none: bool = False) -> int | None:
    """``state[key]``, a non-negative int (or None where ``none``); else a ValueError naming it."""
    value = state.get(key)
    if (value is None and none) or (type(value) is int and value >= 0):
        return value
    refuse_state("LRScheduler", key, value, "a non-negative int" + " or None" * none)


def _layout(value: Any) -> Any:
    """What a saved scheduler state's entry shares with this scheduler's: its kind, a list's length.

    An int where a float was, or the reverse, is the same setting.
    """
    if isinstance(value, (list, tuple)):
        return len(value)
    return "number" if isinstance(value, Real) and not isinstance(value, bool) else type(value)


class ReduceLROnPlateau(MonitorCallback):
    """Multiplies the learning rate by ``factor`` when ``monitor`` stops improving.

    Keras semantics: after ``patience`` epochs without improvement, every
    param group's ``"lr"`` of ``model.optimizer`` becomes
    ``max(lr * factor, min_lr)`` (a group already at or below ``min_lr`` is
    left alone) and the wait restarts.

    ``cooldown`` counts as in Keras and Paddle: after a reduction at epoch
    ``e``, epochs ``e+1`` to ``e+cooldown-1`` neither count towards
    ``patience`` nor reduce (they still update the best value), and epoch
    ``e+cooldown`` counts again. So ``cooldown=1`` is the same as 0, and with
    ``patience=1, cooldown=2`` a flat figure reduces at epochs 1, 3, 5...
    (PyTorch's own ``ReduceLROnPlateau`` skips one epoch more.)

    Args:
        monitor: the logged figure to watch (default ``"val_loss"``).
        factor: multiplier in (0, 1).
        patience: epochs without improvement before a reduction.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (see :class:`MonitorCallback`).
        min_delta: smallest change that counts as an improvement.
        cooldown: epochs after a reduction until the epochs count again
            (the ``cooldown``-th epoch after it counts).
        min_lr: lower bound of every group's learning rate.
        verbose: print each reduction (main process only).
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        factor: float = 0.1,
        patience: int = 10,
        mode: str = "auto",
        min_delta: float = 1e-4,
        cooldown: int = 0,
        min_lr: float = 0.0,
        verbose: int = 1,
    ) -> None:
        super().__init__(monitor=monitor, mode=mode, min_delta=min_delta)
        self.factor = require_number(
            "ReduceLROnPlateau", "factor", factor, "in (0, 1)", lambda v: 0 < v < 1, 0.1
        )
        self.min_lr = require_number(
            "ReduceLROnPlateau", "min_lr", min_lr, "a non-negative number", lambda v: v >= 0, 1e-6
        )
        self.patience = require_int("ReduceLROnPlateau", "patience", patience, minimum=0)
        self.cooldown = require_int("ReduceLROnPlateau", "cooldown", cooldown, minimum=0)
        self.verbose = verbose
        self.cooldown_counter = 0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "cooldown_counter": self.cooldown_counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.cooldown_counter = int(state["cooldown_counter"])

    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        self.cooldown_counter = 0

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        current = self.get_monitor_value(logs)
        if current is None:
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self._is_improvement(current, self.best):
            self.best, self.wait = current, 0
            return
        if self.cooldown_counter > 0:  # read after the decrement: the cooldown's last epoch counts
            return
        self.wait += 1
        if self.wait < self.patience:
            return
        self.cooldown_counter, self.wait = self.cooldown, 0
        changes = []  # every group's lr lowered: "old -> new" for those that changed
        for group in self.model.optimizer.param_groups:
            old = float(group["lr"])
            if old > self.min_lr:
                new = max(old * self.factor, self.min_lr)
                # A tensor lr (capturable optimizers) stays that tensor.
                group["lr"] = group["lr"].fill_(new) if torch.is_tensor(group["lr"]) else new
                changes.append(f"{old:.4g} -> {new:.4g}")
        if changes and self.verbose and self.is_main:
            text = ", ".join(changes)
            tqdm.write(f"Epoch {epoch + 1}: ReduceLROnPlateau reducing learning rate: {text}.")
