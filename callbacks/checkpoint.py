"""ModelCheckpoint (periodic, best and final checkpoints) and BackupAndRestore (resume after a crash).

Paddle semantics for the file names (``<save_dir>/<epoch>.pt``,
``<save_dir>/final.pt``), plus Keras' "best so far" on a monitored figure
(``<save_dir>/best.pt``). ``model.save`` is collective -- every rank calls it,
rank 0 writes, all wait -- so this callback calls it on every rank and never
behind ``is_main`` (that would deadlock the other ranks in the barrier).
"""

from __future__ import annotations

import os
import shutil

from tqdm import tqdm

from callbacks.base import Callback
from callbacks.files import remove_with_spare
from callbacks.monitor import MonitorCallback, require_int


class ModelCheckpoint(MonitorCallback):
    """Saves the model every ``save_freq`` epochs, on improvement, and at the end.

    * ``<save_dir>/<epoch>.pt`` when ``epoch % save_freq == 0`` (0-based
      epoch, as Paddle), unless ``save_best_only``;
    * ``<save_dir>/best.pt`` whenever ``logs[monitor]`` improves on the best
      so far (epochs without the key, e.g. without evaluation, are skipped);
    * ``<save_dir>/final.pt`` at the end of training, unless ``save_best_only``.

    Args:
        save_dir: directory of the checkpoints (first argument; Paddle's order
            ``ModelCheckpoint(save_freq, save_dir)`` is refused with a TypeError).
        save_freq: epochs between periodic checkpoints, a positive int.
        monitor: the logged figure that decides "best" (default ``"val_loss"``).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (see :class:`MonitorCallback`).
        save_best_only: write only ``best.pt``; a missing ``monitor`` then
            warns (once), since nothing would ever be saved.
        verbose: print each save (main process only).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        save_freq: int = 1,
        monitor: str = "val_loss",
        mode: str = "auto",
        save_best_only: bool = False,
        verbose: int = 0,
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

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.best = self.initial_best

    def _save(self, name: str, epoch: int | None, reason: str = "") -> None:
        path = os.path.join(self.save_dir, name)
        if self.verbose and self.is_main:
            prefix = "" if epoch is None else f"Epoch {epoch + 1}: "
            tqdm.write(f"{prefix}{reason}saving model to {path}.pt")
        self.model.save(path)  # collective: every rank, never behind is_main

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not self.save_best_only and epoch % self.save_freq == 0:
            self._save(str(epoch), epoch)
        # Without save_best_only, best.pt is an extra: a run without
        # evaluation should not warn about a missing val_loss every time.
        current = self.get_monitor_value(logs, warn=self.save_best_only)
        if current is not None and self.is_improvement(current, self.best):
            reason = f"{self.monitor} improved from {self.best:.5g} to {current:.5g}, "
            self.best = current
            self._save("best", epoch, reason)

    def on_train_end(self, logs: dict | None = None) -> None:
        if not self.save_best_only:
            self._save("final", None)


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
    unless ``delete_checkpoint=False``.

    Fit runs this callback's ``on_train_begin`` after every other callback's,
    so what they reset there is then restored.

    Args:
        backup_dir: directory of the backup file.
        save_freq: ``"epoch"`` (at each epoch end) or a positive int: every
            that many optimizer steps (``model.step``), i.e. only after an
            update, never between accumulated batches.
        delete_checkpoint: remove the backup when training ends normally.
    """

    FILE_NAME = "backup"

    def __init__(self, backup_dir: str | os.PathLike, save_freq: str | int = "epoch",
                 delete_checkpoint: bool = True) -> None:
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)):
            raise TypeError(
                f"BackupAndRestore: backup_dir must be a directory path (str or os.PathLike); "
                f"received {backup_dir!r} of type {type(backup_dir).__name__}."
            )
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int)
                                     or save_freq < 1):
            raise ValueError(f"BackupAndRestore: save_freq must be 'epoch' or a positive number of "
                             f"optimizer steps; received {save_freq!r}.")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = bool(delete_checkpoint)
        self._last_step = 0

    @property
    def path(self) -> str:
        """The backup as ``model.save``/``load`` name it (the file adds ``.pt``)."""
        return os.path.join(self.backup_dir, self.FILE_NAME)

    def on_train_begin(self, logs: dict | None = None) -> None:
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
                tqdm.write(f"BackupAndRestore: resuming from {file} at epoch {self.model.epoch + 1}, "
                           f"batch {self.model.epoch_step} (optimizer step {self.model.step}).")
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
        self.model.save(self.path, resumable=True, sharded=self.model.sharded, wait=False)

    def on_train_end(self, logs: dict | None = None) -> None:
        # Every process deletes its machine's copy: one left by a rank 0 that a restart
        # moved elsewhere would otherwise "resume" the next, unrelated run.
        self.model.wait_for_saves()  # the last backup's write must not land after the deletion
        if self.delete_checkpoint:
            remove_with_spare(self.path + ".pt")
            if self.is_main:  # a sharded backup: one directory that every process sees
                shutil.rmtree(self.path, ignore_errors=True)
