"""ModelCheckpoint: periodic, step, best and final checkpoints of a fit.

Paddle semantics for the file names (``<save_dir>/<epoch>.pt``,
``<save_dir>/final.pt``), plus Keras' "best so far" on a monitored figure
(``<save_dir>/best.pt``) and checkpoints every N optimizer steps
(``<save_dir>/step-<N>.pt``). ``model.save`` is collective -- every rank calls
it, rank 0 writes, all wait -- so this callback calls it on every rank and never
behind ``is_main`` (that would deadlock the other ranks in the barrier); only
what touches files directly (links, deletions) is left to the main process.
"""

from __future__ import annotations

import os
import re
from typing import Any

from tqdm import tqdm

from hapi.checkpoint import files

from .base import stepped_to
from .monitor import MonitorCallback, refuse_state, require_bool, require_int

# The numbered checkpoints ModelCheckpoint writes (<epoch>, step-<N>): the only names it rotates.
_NUMBERED = re.compile(r"\d+|step-\d+")
_STEP = re.compile(r"step-\d+")
# What the warning that the monitor is missing says next, by (no best yet, save_best_only).
_THEN = {
    (False, True): "best.pt keeps the best so far. ",
    (True, True): "Until it is logged, best.pt is written with the latest weights at every epoch "
    "end (as Keras does), so that save_best_only=True still leaves a checkpoint. ",
    (True, False): "No best.pt is written until it is (the numbered files and final.pt are). ",
}


class ModelCheckpoint(MonitorCallback):
    """Saves the model every ``save_freq`` epochs, every ``save_steps`` steps, on improvement, and at the end.

    * ``<save_dir>/<epoch>.pt`` when ``epoch % save_freq == 0`` (0-based
      epoch, as Paddle), unless ``save_best_only``;
    * ``<save_dir>/step-<N>.pt`` with ``save_steps``, whenever ``model.step``
      (optimizer steps over the model's life) reaches a multiple N of
      ``save_steps``: once per optimizer update, so with
      ``accumulate_grad_batches`` never between the batches of a group. When
      that step is the last batch of an epoch whose ``<epoch>.pt`` is saved
      too, the checkpoint is written once, at the epoch's end (after its
      evaluation), and ``step-<N>.pt`` is a second name for that file (a hard
      link; a copy where the file system has none);
    * ``<save_dir>/best.pt`` whenever the monitored figure improves on the
      best so far: at each epoch end (``logs[monitor]``; epochs without the
      key, e.g. without evaluation, are skipped) and, for a ``val_<name>``
      monitor, after every evaluation inside the epoch too (``fit(eval_steps=N)``:
      ``<name>`` of that evaluation's figures), so that an iteration-based run
      keeps its best evaluation, not only its epoch ends. Each evaluation
      counts once: one at the epoch's last batch is judged at the epoch's end
      (the file then holds the finished epoch, as ``<epoch>.pt`` does). With
      ``resumable``, one inside the epoch is written at that step's
      ``on_train_batch_end``, once every callback (an EMA, a schedule) has
      taken the step, so that a fit resumed from it is exact. A monitor never
      logged (a fit without ``eval_data``) writes no ``best.pt``, and warns once;
    * ``<save_dir>/final.pt`` at the end of training, unless ``save_best_only``.

    With ``save_best_only`` and a monitor that has not been logged yet (a
    typo, or no evaluation), ``best.pt`` is written with the latest weights
    at every epoch end, with a warning, as Keras does: the run still leaves a
    checkpoint. Once a value has been judged, an epoch without it keeps the
    best.

    ``<epoch>.pt`` and ``step-<N>.pt`` are the *numbered* checkpoints. With
    ``keep=k`` only the k numbered files this callback wrote last survive: after
    each numbered save the older ones it wrote (in this ``fit`` or an earlier one
    it was given to) are deleted, by the main process. ``best.pt`` and
    ``final.pt`` are never deleted, nor is any file it did not write -- those of
    another run in the same directory stay. The list of files written is part
    of this callback's state, so a fit resumed from one of its checkpoints (or
    by ``BackupAndRestore``) goes on rotating the same files, when it writes to
    the same directory.

    ``resumable=True`` writes every file with ``model.save(path,
    resumable=True)``: besides weights and optimizer, each holds what
    ``model.load(path, resume=True)`` needs to continue that fit exactly -- RNG
    states, data order and position in the epoch, running figures, and every
    callback's state (LRScheduler's schedule, EarlyStopping's counters, this
    callback's best value and files). At an epoch's end the best is judged
    before any file is written, so every file of that moment holds it. A
    resumable ``ModelCheckpoint`` runs after the other callbacks (its
    ``order`` is 1, see :class:`Callback`), so that the state its files hold
    (an ``LRScheduler`` stepping per epoch, ``EarlyStopping``, an EMA) has
    seen the batch or epoch the file is written at, wherever it is listed.

    Args:
        save_dir: directory of the checkpoints (first argument; Paddle's order
            ``ModelCheckpoint(save_freq, save_dir)`` is refused with a TypeError).
        save_freq: epochs between periodic checkpoints, a positive int.
        monitor: the logged figure that decides "best" (default ``"val_loss"``).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (see :class:`MonitorCallback`).
        save_best_only: write only ``best.pt``; a missing ``monitor`` then
            warns (once) and, until it is first logged, ``best.pt`` is written
            at every epoch end anyway (Keras).
        verbose: print each save (main process only).
        save_steps: ``None`` (default) or a positive int: also save every that
            many optimizer steps.
        keep: ``None`` (default: keep all) or a positive int: how many numbered
            checkpoints to keep.
        resumable: write files that ``model.load(path, resume=True)`` (and so
            a resumed ``fit``) can continue training from. Larger files: each
            process's RNG states and the callbacks' state are added.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        save_freq: int = 1,
        monitor: str = "val_loss",
        mode: str = "auto",
        save_best_only: bool = False,
        verbose: int = 0,
        save_steps: int | None = None,
        keep: int | None = None,
        resumable: bool = False,
    ) -> None:
        if not isinstance(save_dir, (str, os.PathLike)):
            raise TypeError(
                f"ModelCheckpoint: the first argument is save_dir, a directory path; received "
                f"{save_dir!r} of type {type(save_dir).__name__}. Paddle's order (save_freq, "
                "save_dir) is not supported: pass ModelCheckpoint(save_dir='ckpt', save_freq=1)."
            )
        super().__init__(monitor=monitor, mode=mode, min_delta=0.0)
        self.save_dir = os.fspath(save_dir)
        self.save_freq = require_int("ModelCheckpoint", "save_freq", save_freq, minimum=1)
        self.save_best_only = bool(save_best_only)
        self.verbose = verbose
        self.save_steps = require_int("ModelCheckpoint", "save_steps", save_steps, allow_none=True)
        self.keep = require_int("ModelCheckpoint", "keep", keep, allow_none=True)
        self.resumable = require_bool("ModelCheckpoint", "resumable", resumable)
        if self.save_best_only and self.save_steps is not None:
            raise ValueError(
                f"ModelCheckpoint: save_best_only=True writes only best.pt, so save_steps={save_steps} "
                "would never save; pass save_best_only=False, or drop save_steps."
            )
        # The name of the monitored figure in an evaluation's own logs ("val_acc" -> "acc"):
        # only a val_ monitor is judged after each evaluation.
        self._eval_name = monitor[len("val_") :] if monitor.startswith("val_") else None
        unused = () if self._eval_name else ("on_eval_end",)
        if self.save_steps is None and not (self._eval_name and resumable):
            unused += ("on_train_batch_end",)
        self.unused_hooks = unused  # see CallbackList.append
        self._written: list[str] = []  # numbered checkpoints this callback wrote, oldest first
        self._forget(0)

    def _forget(self, step: int) -> None:
        """A fit's start: nothing is left to write or judge; ``step`` is the last one looked at."""
        # _pending_step: a step checkpoint left to the epoch's end; _deferred: an evaluation
        # at the epoch's last batch, judged at the epoch's end ([value, step]); _judged_step:
        # model.step of the last evaluation judged at on_eval_end; _best_due: a best judged
        # mid-step, saved at its end (prefix, reason).
        self._last_step, self._pending_step, self._best_due = step, None, None
        self._deferred, self._judged_step = [], -1

    # -- state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "save_dir": os.path.abspath(self.save_dir),
            "written": list(self._written),
            "last_step": self._last_step,
            "pending_step": self._pending_step or "",
            "deferred": list(self._deferred),
            "judged_step": self._judged_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state_dict`'s values, refusing file names that are not this callback's.

        The names are joined to ``save_dir`` and written or deleted later, and
        a state comes from a file: each must be a numbered checkpoint's name
        (``<epoch>`` or ``step-<N>``), nothing that leads out of ``save_dir``.

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            ValueError: an entry of ``written`` or ``pending_step`` is not such
                a name, or ``deferred`` is not ``[]`` or ``[value, step]`` (the
                error names the entry and the value); nothing is taken back then.
            TypeError: a count or figure is not a number (ValueError for a
                string); nothing is taken back then either.
        """
        listed = state.get("written", [])
        if not isinstance(listed, (list, tuple)):  # a string would list its characters
            refuse_state("ModelCheckpoint", "written", listed, "a list of file names")
        written = [
            files.check_name(name, f"ModelCheckpoint state 'written'[{index}]", _NUMBERED)
            for index, name in enumerate(listed)
        ]
        pending = state.get("pending_step") or None  # "" when there is none
        if pending is not None:
            files.check_name(pending, "ModelCheckpoint state 'pending_step'", _STEP)
        deferred = state.get("deferred") or []
        if deferred:
            if not (isinstance(deferred, (list, tuple)) and len(deferred) == 2):
                refuse_state("ModelCheckpoint", "deferred", deferred, "[] or [value, step]")
            deferred = [float(deferred[0]), int(deferred[1])]
        # The step last looked at: a resume must not save that step again (between
        # the batches of its next group, a file that could not resume exactly).
        last_step = int(state.get("last_step", self._last_step))
        judged_step = int(state.get("judged_step", -1))
        super().load_state_dict(state)
        self._last_step, self._judged_step = last_step, judged_step
        self._pending_step, self._deferred = pending, deferred
        # Files listed for another directory are not this run's to rotate.
        if state.get("save_dir") == os.path.abspath(self.save_dir):
            self._written = written

    # -- hooks ----------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        super().on_train_begin(logs)
        self._forget(self.model.step)

    def on_train_end(self, logs: dict | None = None) -> None:
        if not self.save_best_only:
            self._save("final", "")

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        self._save_best_due()
        if self.save_steps is None or not stepped_to(self, self.save_steps):
            return  # none wanted, or no optimizer step to save: mid-accumulation, say
        name = f"step-{self.model.step}"
        # This batch ends the epoch and <epoch>.pt is saved right after it (known only when
        # the epoch's length is; otherwise both files are written): one file, two names.
        if self.model.epoch % self.save_freq == 0 and self._at_epoch_end():
            self._pending_step = name  # written once, at the epoch's end
            return
        self._write_numbered([name], self._plan_numbered([name]), f"Step {self.model.step}: ")

    def on_eval_end(self, logs: dict | None = None) -> None:
        """An evaluation inside the fit (``eval_steps``, or the epoch's): judge it for ``best.pt``.

        Its figures cover every process, so every rank decides alike (and
        calls the collective save together). At the epoch's last batch the
        judgement waits for ``on_epoch_end``: no training happens in between,
        and the file then holds the finished epoch.

        Args:
            logs: the evaluation's figures (``loss``, each metric), over every process.
        """
        in_fit = self.params.get("epochs") is not None  # evaluate() alone writes nothing
        value = (logs or {}).get(self._eval_name) if in_fit else None
        if value is None:
            return
        if self._at_epoch_end():
            self._deferred = [float(value), self.model.step]
            return
        self._judged_step = self.model.step
        # A resumable file holds the whole step: it is written after the step's batch-end
        # hooks (an EMA's update, a schedule's step), which run after this evaluation.
        self._judge(float(value), f"Step {self.model.step}: ", later=self.resumable)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._save_best_due()  # judged at an evaluation outside any batch (no epoch length)
        logs = logs or {}
        pending, self._pending_step = self._pending_step, None
        prefix = f"Epoch {epoch + 1}: "
        # A pending step file is written alone when the epoch save it waited for does not come.
        numbered = [pending] if pending else []
        if not self.save_best_only and epoch % self.save_freq == 0:
            numbered.append(str(epoch))
        # Recorded and judged before any file is written: each file holds both.
        dropped = self._plan_numbered(numbered)
        self._judge_epoch(logs, prefix)
        if numbered:
            step_prefix = prefix if numbered[-1] == str(epoch) else f"Step {self.model.step}: "
            self._write_numbered(numbered, dropped, step_prefix)

    # -- best -----------------------------------------------------------------
    def _judge_epoch(self, logs: dict, prefix: str) -> None:
        """Judge this epoch's figure for ``best.pt``, or say that it is missing.

        An evaluation at this very optimizer step that ``on_eval_end`` judged
        is not judged again (the epoch's own evaluation, when the epoch's end
        could not be told apart); one it left to the epoch's end is judged now.

        Keras writes the checkpoint anyway under ``save_best_only`` when the
        monitor is missing; once a best exists, overwriting it with unjudged
        weights would lose it. Without ``save_best_only`` no ``best.pt`` is
        written until the figure is logged, and the warning says so (the usual
        cause: no ``eval_data``); an epoch without it after one with it (an
        ``eval_freq`` above 1) is no news then.
        """
        deferred, self._deferred = self._deferred, []
        if self._eval_name is not None and self._judged_step == self.model.step:
            return  # judged at on_eval_end a moment ago (only a val_ figure is judged there)
        current = self.get_monitor_value(logs, warn=False)
        if current is None and deferred and deferred[1] == self.model.step:
            current = deferred[0]
        if current is not None:
            self._judge(current, prefix)
            return
        never = self.best == self._initial_best
        if never or self.save_best_only:
            self._warn_missing(logs, _THEN[never, self.save_best_only])
        if never and self.save_best_only:
            self._save("best", prefix, f"{self.monitor} not logged yet, ")

    def _judge(self, current: float, prefix: str, later: bool = False) -> None:
        if self._is_improvement(current, self.best):
            reason = f"{self.monitor} improved from {self.best:.5g} to {current:.5g}, "
            self.best, self._best_due = current, (prefix, reason)
            if not later:
                self._save_best_due()

    def _save_best_due(self) -> None:
        """Write the ``best.pt`` an evaluation judged, once the step or epoch it is in is done."""
        if self._best_due is not None:
            due, self._best_due = self._best_due, None
            self._save("best", *due)

    def _at_epoch_end(self) -> bool:
        """Whether the last batch of the epoch (or of ``num_iters``) has been trained.

        ``False`` when the epoch's length is unknown: the evaluation is then
        judged at once, and the epoch's end does not judge it again.
        """
        steps, num_iters = self.params.get("steps"), self.params.get("num_iters")
        done = getattr(self.model, "epoch_step", None)
        if not steps or done is None:
            return False
        return (
            done >= steps or num_iters is not None and self.model.epoch * steps + done >= num_iters
        )

    # -- files ----------------------------------------------------------------
    @property
    def order(self) -> int:  # type: ignore[override]
        """Resumable, it runs after the others: its files hold their state (``Callback.order``)."""
        return 1 if self.resumable else 0

    def _file(self, name: str) -> str:
        return files.child(self.save_dir, name, "ModelCheckpoint's file name") + ".pt"

    def _save(self, name: str, prefix: str, reason: str = "") -> None:
        path = files.child(self.save_dir, name, "ModelCheckpoint's file name")
        if self.verbose and self.is_main:
            tqdm.write(f"{prefix}{reason}saving model to {path}.pt")
        # Collective: every rank, never behind is_main. ``resumable`` only when asked for, so
        # that a Model subclass's own save(path, training=True) still serves.
        self.model.save(path, **({"resumable": True} if self.resumable else {}))

    def _plan_numbered(self, names: list[str]) -> list[str]:
        """Record ``names`` as the newest numbered files; return those ``keep`` drops.

        Recorded before the save, so that a resumable file lists itself among
        the files a resumed run goes on rotating.
        """
        # A name written again (e.g. by a second fit) is now the newest.
        written = [name for name in self._written if name not in names] + names
        dropped = written[: -self.keep] if self.keep is not None else []
        self._written = written[len(dropped) :]
        return dropped

    def _write_numbered(self, names: list[str], dropped: list[str], prefix: str) -> None:
        """Write the last of ``names``, give it the other names, delete ``dropped``."""
        self._save(names[-1], prefix)
        if not self.is_main:
            return  # only the main process wrote, so only it links and deletes
        written = self._file(names[-1])
        for name in [name for name in names[:-1] if name not in dropped]:  # its other names
            if self.verbose:
                tqdm.write(f"{prefix}{self._file(name)} is the same checkpoint as {written}")
            files.link_or_copy(written, self._file(name))
        for name in dropped:
            files.remove_with_spare(self._file(name))
