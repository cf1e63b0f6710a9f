"""ModelCheckpoint (periodic, best and final checkpoints) and BackupAndRestore (resume after a crash).

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

from . import files
from .base import Callback
from .monitor import MonitorCallback, require_int

# The numbered checkpoints ModelCheckpoint writes (<epoch>, step-<N>): the only names it rotates.
_NUMBERED = re.compile(r"\d+|step-\d+")
_STEP = re.compile(r"step-\d+")


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
    * ``<save_dir>/best.pt`` whenever ``logs[monitor]`` improves on the best
      so far (epochs without the key, e.g. without evaluation, are skipped);
    * ``<save_dir>/final.pt`` at the end of training, unless ``save_best_only``.

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
    callback's best value and files). A file holds other callbacks' state as
    it is when this callback saves, and callbacks run in list order: list
    ``ModelCheckpoint`` after the callbacks whose state matters (an
    ``LRScheduler`` stepping per epoch, ``EarlyStopping``, an EMA), so that
    they have seen the batch or epoch the file is written at.

    Args:
        save_dir: directory of the checkpoints (first argument; Paddle's order
            ``ModelCheckpoint(save_freq, save_dir)`` is refused with a TypeError).
        save_freq: epochs between periodic checkpoints, a positive int.
        monitor: the logged figure that decides "best" (default ``"val_loss"``).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (see :class:`MonitorCallback`).
        save_best_only: write only ``best.pt``; a missing ``monitor`` then
            warns (once), since nothing would ever be saved.
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
                f"ModelCheckpoint: the first argument is save_dir, a directory path (str or "
                f"os.PathLike); received {save_dir!r} of type {type(save_dir).__name__}. "
                "Paddle's positional order ModelCheckpoint(save_freq, save_dir) is not supported: "
                "use keywords, e.g. ModelCheckpoint(save_dir='ckpt', save_freq=1)."
            )
        super().__init__(monitor=monitor, mode=mode, min_delta=0.0)
        self.save_dir = os.fspath(save_dir)
        self.save_freq = require_int("ModelCheckpoint", "save_freq", save_freq, minimum=1)
        self.save_best_only = bool(save_best_only)
        self.verbose = verbose
        self.save_steps = (
            None
            if save_steps is None
            else require_int("ModelCheckpoint", "save_steps", save_steps, minimum=1)
        )
        self.keep = (
            None if keep is None else require_int("ModelCheckpoint", "keep", keep, minimum=1)
        )
        if not isinstance(resumable, bool):
            raise TypeError(
                f"ModelCheckpoint: resumable must be True or False; received {resumable!r} "
                f"({type(resumable).__name__})."
            )
        self.resumable = resumable
        if self.save_best_only and self.save_steps is not None:
            raise ValueError(
                f"ModelCheckpoint: save_best_only=True writes only best.pt, so save_steps={save_steps} "
                "would never save; pass save_best_only=False to have step checkpoints (and the "
                "periodic and final ones), or drop save_steps."
            )
        if self.save_steps is None:
            self.unused_hooks = ("on_train_batch_end",)  # see callbacks.base._overrides
        self._written: list[str] = []  # numbered checkpoints this callback wrote, oldest first
        self._last_step = 0  # model.step when on_train_batch_end last looked
        self._pending_step: str | None = None  # a step checkpoint left to the epoch's end

    # -- state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "save_dir": os.path.abspath(self.save_dir),
            "written": list(self._written),
            "last_step": self._last_step,
            "pending_step": self._pending_step or "",
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state_dict`'s values, refusing file names that are not this callback's.

        The names are joined to ``save_dir`` and written or deleted later, and
        a state comes from a file: each must be a numbered checkpoint's name
        (``<epoch>`` or ``step-<N>``), nothing that leads out of ``save_dir``.

        Raises:
            ValueError: an entry of ``written`` or ``pending_step`` is not such
                a name (the error names the entry and the value); nothing is
                taken back then.
        """
        written = state.get("written", [])
        if not isinstance(written, (list, tuple)):
            raise files.UnsafeNameError(
                f"ModelCheckpoint state 'written' must be a list of file names; received "
                f"{written!r}. The checkpoint it came from is damaged or was crafted."
            )
        written = [
            files.check_name(name, f"ModelCheckpoint state 'written'[{index}]", _NUMBERED)
            for index, name in enumerate(written)
        ]
        pending = state.get("pending_step") or None  # "" when there is none
        if pending is not None:
            files.check_name(pending, "ModelCheckpoint state 'pending_step'", _STEP)
        super().load_state_dict(state)
        # The step last looked at: a resume must not save that step again (between
        # the batches of its next group, a file that could not resume exactly).
        self._last_step = int(state.get("last_step", self._last_step))
        self._pending_step = pending
        # Files listed for another directory are not this run's to rotate.
        if state.get("save_dir") == os.path.abspath(self.save_dir):
            self._written = written

    # -- hooks ----------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        self.best = self.initial_best
        self._last_step = self.model.step
        self._pending_step = None

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        if self.save_steps is None or self.model.step == self._last_step:
            return  # no optimizer step since the last look: mid-accumulation, or none wanted
        self._last_step = self.model.step
        if self.model.step % self.save_steps:
            return
        name = f"step-{self.model.step}"
        if self._epoch_save_follows():
            self._pending_step = name  # written once, at the epoch's end, under both names
            return
        self._save_numbered([name], name, f"Step {self.model.step}: ")

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        pending, self._pending_step = self._pending_step, None
        if not self.save_best_only and epoch % self.save_freq == 0:
            names = ([pending] if pending else []) + [str(epoch)]
            self._save_numbered(names, str(epoch), f"Epoch {epoch + 1}: ")
        elif pending:  # the epoch save announced at its last batch did not come
            self._save_numbered([pending], pending, f"Step {self.model.step}: ")
        # Without save_best_only, best.pt is an extra: a run without
        # evaluation should not warn about a missing val_loss every time.
        current = self.get_monitor_value(logs, warn=self.save_best_only)
        if current is not None and self.is_improvement(current, self.best):
            reason = f"{self.monitor} improved from {self.best:.5g} to {current:.5g}, "
            self.best = current
            self._save("best", f"Epoch {epoch + 1}: ", reason)

    def on_train_end(self, logs: dict | None = None) -> None:
        if not self.save_best_only:
            self._save("final", "")

    # -- files ----------------------------------------------------------------
    def _epoch_save_follows(self) -> bool:
        """Whether this batch ends the epoch and ``<epoch>.pt`` is saved right after it.

        Known only when the epoch's length is; otherwise both files are written.
        """
        steps = self.params.get("steps")
        return (
            self.model.epoch % self.save_freq == 0
            and steps is not None
            and getattr(self.model, "epoch_step", None) == steps
        )

    def _file(self, name: str) -> str:
        return files.child(self.save_dir, name, "ModelCheckpoint's file name") + ".pt"

    def _save(self, name: str, prefix: str, reason: str = "") -> None:
        path = files.child(self.save_dir, name, "ModelCheckpoint's file name")
        if self.verbose and self.is_main:
            tqdm.write(f"{prefix}{reason}saving model to {path}.pt")
        # Collective: every rank, never behind is_main.
        if self.resumable:
            self.model.save(path, resumable=True)
        else:
            self.model.save(path)

    def _save_numbered(self, names: list[str], written: str, prefix: str) -> None:
        """Write ``written`` (one of ``names``), give it the other names, and apply ``keep``.

        The names are recorded before the save, so that a resumable file
        lists itself among the files a resumed run goes on rotating.
        """
        for name in names:
            if name in self._written:
                self._written.remove(name)  # written again (e.g. a second fit): now the newest
            self._written.append(name)
        dropped: list[str] = []
        if self.keep is not None and len(self._written) > self.keep:
            dropped, self._written = self._written[: -self.keep], self._written[-self.keep :]
        self._save(written, prefix)
        if not self.is_main:
            return  # only the main process wrote, so only it links and deletes
        for name in names:
            if name != written and name not in dropped:
                if self.verbose:
                    tqdm.write(
                        f"{prefix}{self._file(name)} is the same checkpoint as {self._file(written)}"
                    )
                files.link_or_copy(self._file(written), self._file(name))
        for name in dropped:
            files.remove_with_spare(self._file(name))


class BackupAndRestore(Callback):
    """Resume an interrupted ``fit`` exactly where it stopped, mid-epoch included.

    Every ``save_freq`` (``"epoch"``, or a number of optimizer steps) the
    whole training state goes to ``<backup_dir>/backup.pt`` -- weights,
    optimizer, gradient scaler, LR scheduler (through ``LRScheduler``'s
    state), RNG states (torch, CUDA, NumPy, Python), the data order and the
    position in the epoch, the running figures, and every callback's state
    (EarlyStopping's best and wait, ModelCheckpoint's best, ...). The file is
    replaced atomically, so a crash while writing leaves the previous backup.

    When the same script starts again (by hand, or when ``torchrun
    --max-restarts`` restarts the workers), ``on_train_begin`` finds the
    backup and ``fit`` continues from it: the final weights equal those of a
    run never interrupted. The backup is deleted when training ends normally,
    unless ``delete_checkpoint=False``: the file it wrote (and the hidden
    spare beside it), and, under FSDP, the sharded backup's manifest and
    shards directories -- never anything else in ``backup_dir``. Then
    ``backup_dir`` itself goes if it is empty and was made for this training
    (absent when the fit began, or holding nothing but an interrupted run's
    backup), as Keras removes its backup directory.

    Fit runs this callback's ``on_train_begin`` after every other callback's,
    so what they reset there is then restored.

    Args:
        backup_dir: directory of the backup file (not empty: ``""`` would
            back up into the working directory).
        save_freq: ``"epoch"`` (at each epoch end) or a positive int: every
            that many optimizer steps (``model.step``), i.e. only after an
            update, never between accumulated batches.
        delete_checkpoint: remove the backup when training ends normally.

    Raises:
        ValueError: ``backup_dir`` is ``None`` or empty (as Keras and Paddle
            refuse it), or ``save_freq`` is neither ``"epoch"`` nor a positive int.
        TypeError: ``backup_dir`` is not a path.
    """

    FILE_NAME = "backup"
    resumable = True  # its files continue a fit (fit warns at once when that cannot be exact)

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
    ) -> None:
        super().__init__()
        if backup_dir is None or (
            isinstance(backup_dir, (str, os.PathLike)) and not os.fspath(backup_dir)
        ):
            raise ValueError(
                f"BackupAndRestore: backup_dir must name a directory; received {backup_dir!r}. "
                "Pass the directory to keep the backup in, e.g. BackupAndRestore('backup')."
            )
        if not isinstance(backup_dir, (str, os.PathLike)):
            raise TypeError(
                f"BackupAndRestore: backup_dir must be a directory path (str or os.PathLike); "
                f"received {backup_dir!r} of type {type(backup_dir).__name__}."
            )
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(
                f"BackupAndRestore: save_freq must be 'epoch' or a positive number of "
                f"optimizer steps; received {save_freq!r}."
            )
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = bool(delete_checkpoint)
        self._last_step = 0
        # Decided at on_train_begin: what this fit may delete at its end.
        self._sharded_backup = False  # a sharded backup was read or written by this fit
        self._made_for_training = False  # backup_dir was absent, or held only a backup

    @property
    def path(self) -> str:
        """The backup as ``model.save``/``load`` name it (the file adds ``.pt``)."""
        return os.path.join(self.backup_dir, self.FILE_NAME)

    def _own_entries(self) -> set[str]:
        """The names this callback writes in ``backup_dir``."""
        file = self.FILE_NAME + ".pt"
        return {file, os.path.basename(files.spare_of(file)), self.FILE_NAME}

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Before any backup of this fit (the load below is collective): what is there now
        # is not this fit's to delete, unless it is a backup an interrupted run left.
        try:
            entries = set(os.listdir(self.backup_dir))
        except FileNotFoundError:
            entries = set()
        self._made_for_training = not os.path.exists(self.backup_dir) or bool(
            entries and entries <= self._own_entries()
        )
        self._sharded_backup = os.path.isfile(os.path.join(self.path, files.MANIFEST))
        # Every process asks, and gets the latest backup on any machine: only rank 0
        # writes it, and a restart may have moved rank 0 to a machine without one.
        file = self.path + ".pt"
        try:
            self.model.load(self.path, resume=True)
        except FileNotFoundError:
            pass  # no backup: a first run starts from scratch
        except (RuntimeError, ValueError) as error:
            raise RuntimeError(
                f"BackupAndRestore could not resume from {file}: {error} To start training "
                f"from scratch instead, delete {file}."
            ) from error
        else:
            if self.is_main:
                tqdm.write(
                    f"BackupAndRestore: resuming from {file} at epoch {self.model.epoch + 1}, "
                    f"batch {self.model.epoch_step} (optimizer step {self.model.step})."
                )
        self._last_step = self.model.step

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        if self.save_freq == "epoch" or self.model.step == self._last_step:
            return  # no optimizer step since the last look: gradients may be mid-accumulation
        self._last_step = self.model.step
        if self.model.step % self.save_freq == 0:
            self._back_up()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.save_freq == "epoch":
            self._back_up()

    def _back_up(self) -> None:
        # Collective: every rank calls it. Under FSDP every process writes its own shards
        # (a directory <backup_dir>/backup/), so no process ever holds the whole model.
        # The file is written in the background: training goes on once the state is
        # copied to CPU memory, and the previous backup stays until the new one is whole.
        sharded = self.model.sharded
        self._sharded_backup |= sharded
        self.model.save(self.path, resumable=True, sharded=sharded, wait=False)

    def on_train_end(self, logs: dict | None = None) -> None:
        # Every process deletes its machine's copy: one left by a rank 0 that a restart
        # moved elsewhere would otherwise "resume" the next, unrelated run.
        self.model.wait_for_saves()  # the last backup's write must not land after the deletion
        if not self.delete_checkpoint:
            return
        files.remove_with_spare(self.path + ".pt")
        if self._sharded_backup and self.is_main:  # one directory that every process sees
            # Its manifest and shards only: a file of the user's there stays, with the directory.
            files.remove_sharded(self.path)
        if self._made_for_training:
            files.remove_empty_directory(self.backup_dir)
