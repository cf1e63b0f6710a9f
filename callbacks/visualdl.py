"""VisualDL: training curves for the VisualDL dashboard (``visualdl --logdir``).

Only the main process writes (other ranks never create a file or directory),
and ``visualdl`` is imported on the first write, not at import time, because
importing it costs about 0.4 s that a run without this callback should not pay.

The choice of scalars, tags and steps lives in :class:`_ScalarLogger`, which
``callbacks.tensorboard.TensorBoard`` shares, so that the two dashboards show
the same curves for the same run; each subclass only says how to open its
writer.

Each run gets its own directory. Both dashboards treat every directory under
``--logdir`` that holds records as one run, and VisualDL shows only the newest
record file of a directory (visualdl 2.5.3, checked through its JSON API), so
runs that shared one directory hid each other.
By default a callback therefore writes into ``<log_dir>/version_<N>``, N one
more than the largest ``version_*`` already there (0 for the first), as
Lightning numbers its versions: numbers then follow the order the runs started
in, even after an old run is deleted. Point the dashboard at ``log_dir`` to
see every run side by side (checked with visualdl 2.5.3: ``/app/api/runs``
lists ``<log_dir>/version_0``, ``<log_dir>/version_1``, ...). The directory is
chosen once per callback object, by the main process, at its first write (or
at the first checkpoint that saves the callback's state, if that comes first),
and reserved with ``os.mkdir`` so that two runs starting together cannot pick
the same number. A run resumed by ``BackupAndRestore`` gets the name back from
the callback's state and keeps writing into the same directory.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
from typing import Any

from hapi.checkpoint import files

from .base import NOT_FIGURES, Callback, as_path

# What ``version=`` accepts: "auto" (or True), an int, a subdirectory name, or None/False.
Version = int | str | bool | None
AUTO = "auto"
_VERSION_DIR = re.compile(r"version_(\d+)")


def _run_name(owner: str, version: Version) -> str | None:
    """The run's subdirectory for a fixed ``version`` (None: ``log_dir`` itself), or AUTO."""
    if version is True or version == AUTO:
        return AUTO
    if version is None or version is False:
        return None
    if isinstance(version, int) and version < 0:
        raise ValueError(
            f"{owner}: version must be a non-negative integer (it names version_<N>); received "
            f"{version}. Pass e.g. version=0."
        )
    if isinstance(version, int):
        return f"version_{version}"
    if not isinstance(version, str):
        raise TypeError(
            f"{owner}: version must be 'auto', an int, a subdirectory name (str), or None; "
            f"received {version!r} of type {type(version).__name__}."
        )
    if os.path.isabs(version) or {"", ".", ".."} & set(version.replace("\\", "/").split("/")):
        raise ValueError(
            f"{owner}: version={version!r} must name a subdirectory of log_dir (e.g. 'baseline' "
            "or 'lr1e-3/seed0'), with no empty, '.' or '..' parts and not an absolute path. To "
            "write into another directory, change log_dir; for log_dir itself pass version=None."
        )
    return version


class _Curves(Callback):
    """The x axes VisualDL, TensorBoard and W&B share, and the training scalars of a batch.

    :attr:`train_step` counts the batches this callback has seen begin, as Keras'
    TensorBoard counts its global batch (not ``model.step``, the optimizer steps:
    with accumulation every batch still gets its own point). An evaluation that
    ``fit(eval_steps=N)`` runs after a step's update comes before that step's
    ``on_train_batch_end``: it belongs to that batch, which has begun and is counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.train_step = 0

    def on_train_batch_begin(self, step: int, logs: dict | None = None) -> None:
        self.train_step += 1

    def _train_scalars(self, logs: dict | None) -> dict[str, float]:
        """The batch's figures and ``lr`` (none between ``log_freq`` steps)."""
        scalars = {k: float(v) for k, v in (logs or {}).items() if k not in NOT_FIGURES}
        optimizer = getattr(self.model, "optimizer", None)
        if scalars and optimizer is not None:
            scalars["lr"] = float(optimizer.param_groups[0]["lr"])
        return scalars


class _ScalarLogger(_Curves):
    """Decides which scalars are written, under which tags, at which steps
    (listed in :class:`VisualDL`'s docstring), for VisualDL and TensorBoard alike.

    The x axis of training is :attr:`train_step` (:class:`_Curves`). In a ``fit`` with ``eval_steps``
    (``params["eval_steps"]`` set) evaluations are plotted on that same axis,
    at :attr:`train_step` when they end, so several evaluations in one epoch
    no longer share the epoch's x and the two curves can be read together.
    Without ``eval_steps`` they stay at the epoch index, as before.

    One writer per callback, opened on the first write by the main process
    only; flushed (not closed) at the end of training and after a standalone
    evaluation, so the file is complete when the call returns and a later
    ``evaluate`` with the same callback appends to it; closed by :meth:`close`
    or at interpreter exit. Subclasses implement ``_open_writer()``, which makes the writer
    for :attr:`run_dir`: it has ``add_scalar(tag, value, step)``, ``flush()`` and ``close()``.
    """

    def __init__(self, log_dir: str | os.PathLike, version: Version = AUTO) -> None:
        super().__init__()
        name = type(self).__name__
        self.log_dir = as_path(name, "log_dir", log_dir, "directory", "runs/lenet")
        run = _run_name(name, version)
        self._auto = run == AUTO
        # The run's subdirectory of log_dir: None for log_dir itself, or, with
        # "auto", until the main process picks version_<N>.
        self._run: str | None = None if self._auto else run
        self.next_eval_step = 1  # where the next standalone evaluate is plotted
        self._writer: Any = None

    @property
    def run_dir(self) -> str | None:
        """The directory this run's records go to (``log_dir`` or a subdirectory of it).

        ``None`` with ``version="auto"`` until the number is chosen: on the main
        process at the first write; other processes never choose one (they
        learn it only from a restored state).
        """
        if self._auto and self._run is None:
            return None
        return self.log_dir if self._run is None else os.path.join(self.log_dir, self._run)

    def _choose_run_dir(self) -> None:
        """The run directory, choosing (and creating) ``version_<N>`` the first time.

        ``os.mkdir`` fails on a name that exists, so of two runs that list the
        directory at the same moment one gets N and the other retries with N+1.
        """
        while self._auto and self._run is None:
            os.makedirs(self.log_dir, exist_ok=True)
            listed = map(_VERSION_DIR.fullmatch, os.listdir(self.log_dir))
            taken = [int(match.group(1)) for match in listed if match]
            name = f"version_{max(taken) + 1 if taken else 0}"
            with contextlib.suppress(FileExistsError):  # taken meanwhile: list again
                os.mkdir(os.path.join(self.log_dir, name))
                self._run = name

    def _write(self, prefix: str, scalars: dict[str, float], step: int) -> None:
        if not self.is_main:
            return
        if self._writer is None:
            self._choose_run_dir()
            self._writer = self._open_writer()
            atexit.register(self.close)
        for name, value in scalars.items():
            self._writer.add_scalar(f"{prefix}/{name}", float(value), step)

    def close(self) -> None:
        """Close the record file; a later write opens a new one."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def state_dict(self) -> dict[str, Any]:
        # A checkpoint can come before the first write (BackupAndRestore every few
        # steps): the main process chooses the run directory now, so that a run
        # resumed from that checkpoint continues in the directory this one goes on with.
        if self.is_main:
            self._choose_run_dir()
        return {
            "train_step": self.train_step,
            "next_eval_step": self.next_eval_step,
            "version": self._run if self._auto else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state_dict`'s values; the run directory only as ``version_<N>``.

        The saved ``version`` is joined to ``log_dir`` and written into, and a
        state comes from a file: it must be a name this callback chooses
        (``version_<N>``, a directory of ``log_dir`` itself, not a link).

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            ValueError: the saved ``version`` is anything else (the error names
                the entry and the value); nothing is taken back then.
        """
        restored = state.get("version")
        if restored is not None:
            entry = f"{type(self).__name__} state 'version'"
            files.child(self.log_dir, restored, entry, _VERSION_DIR, follow_links=False)
        self.train_step = int(state["train_step"])
        self.next_eval_step = int(state.get("next_eval_step", state.get("eval_count", 0) + 1))
        if self._auto and isinstance(restored, str) and restored != self._run:
            # A resumed run: keep writing where the interrupted one wrote. A fixed
            # version (or None) given to this callback wins over the saved one.
            self.close()
            self._run = restored

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        scalars = self._train_scalars(logs)
        if scalars:  # else a step between log_freq steps: nothing new to plot
            self._write("train", scalars, self.train_step)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.next_eval_step = max(self.next_eval_step, epoch + 1)

    def on_eval_end(self, logs: dict | None = None) -> None:
        fitting = self.params.get("epochs") is not None  # None in a standalone evaluate
        if fitting and self.params.get("eval_steps") is not None:
            # The batches trained so far, the x of the train/* curves: the
            # evaluated weights are those the train curve shows at that x.
            step = self.train_step
        elif fitting:
            step = self.model.epoch  # the epoch evaluated (it counts on after on_epoch_end)
        else:
            step = self.next_eval_step
            self.next_eval_step += 1
        self._write("eval", dict(logs or {}), step)
        if not fitting and self._writer is not None:
            self._writer.flush()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.params.get("eval_steps") is not None:
            # A standalone evaluate comes after every batch of this fit (and so
            # after its evaluations): the eval/* curve never runs backwards.
            self.next_eval_step = max(self.next_eval_step, self.train_step + 1)
        if self._writer is not None:
            self._writer.flush()


class VisualDL(_ScalarLogger):
    """Writes scalars with ``visualdl.LogWriter`` into one directory per run.

    * ``train/<name>`` for the loss and each metric in the batch logs, every
      time they carry them (every ``log_freq`` steps and on the last step);
      the step is the global batch number (1-based, counted across epochs and
      across ``fit`` calls on the same callback).
    * ``train/lr``: ``model.optimizer.param_groups[0]["lr"]`` at the same moments.
    * ``eval/<name>`` for each figure of an evaluation. During a ``fit``
      without ``eval_steps`` the step is the epoch index (0-based). During a
      ``fit(eval_steps=N)``, which evaluates several times per epoch, every
      evaluation of that fit, mid-epoch and epoch-end alike, is plotted at the
      global batch number of the last batch trained before it: the x of the
      ``train/*`` curves, so both curves share one axis and an evaluation
      lies where the train curve stood with the same weights. The x counts
      batches, not optimizer steps: with ``accumulate_grad_batches=k`` an
      evaluation after ``s`` optimizer steps (``history.evaluations``'
      ``"step"``) is plotted at the batch whose update made step ``s`` (k * s
      until an epoch ends with a shorter group). A standalone ``evaluate`` comes next: step 1, 2, ... with no
      ``fit`` before it; after a ``fit`` of E epochs without ``eval_steps``
      step E, E+1, ...; after a ``fit`` with ``eval_steps`` that ended at
      batch B, step B+1, B+2, ...; so the curve never runs backwards after a
      fit. (A later ``fit`` with the same callback plots where that fit puts
      its evaluations: epoch indices restart at 0.)

    Everything goes to one record file per callback, in :attr:`run_dir`: the
    writer is flushed (not closed) at the end of training and after a
    standalone evaluation, so the file is complete when the call returns, and
    the same callback given to a later ``evaluate`` adds its ``eval/*``
    scalars to that file. It is closed by :meth:`close` or at interpreter exit.

    Args:
        log_dir: the directory to point ``visualdl --logdir`` at; created on
            the first write by the main process.
        version: which subdirectory of ``log_dir`` this run writes into, so
            that each run is its own curve on the dashboard. ``"auto"``
            (default): ``version_<N>``, N one more than the largest
            ``version_*`` already in ``log_dir`` (0 for the first), chosen at
            the first write; an int N: ``version_<N>``; a str: that
            subdirectory (e.g. ``"lr1e-3"``); ``None`` or ``False``:
            ``log_dir`` itself, as Paddle's ``VisualDL(log_dir)`` writes
            (unlike Lightning, where ``version=None`` means automatic).

    The directory chosen is :attr:`run_dir`, e.g. ``runs/lenet/version_2``.

    Raises:
        TypeError: ``log_dir`` is not a path, or ``version`` is of another type.
        ValueError: ``version`` is a negative int, or a str that is not a
            subdirectory name (absolute, or with ``..``).
    """

    def _open_writer(self) -> Any:
        from visualdl import LogWriter  # lazy: importing visualdl costs ~0.4 s

        return LogWriter(logdir=self.run_dir)
