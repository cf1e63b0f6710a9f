"""BackupAndRestore: resume an interrupted fit where it stopped, from a backup kept beside training."""

from __future__ import annotations

import os

from tqdm import tqdm

from hapi.checkpoint import files
from hapi.messages import warn

from .base import Callback, refuse_argument, stepped_to
from .monitor import refuse_state, require_bool


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
    --max-restarts`` restarts the workers), ``fit`` finds the backup
    (:meth:`restore_backup`) before its first batch and continues from it:
    the final weights equal those of a run never interrupted. The backup is deleted when training ends normally,
    unless ``delete_checkpoint=False``: the file it wrote (and the hidden
    spare beside it), and, under FSDP, the sharded backup's manifest and
    shards directories -- never anything else in ``backup_dir``. Then
    ``backup_dir`` itself goes if it is empty and was made for this training
    (absent when this fit, or the interrupted one it resumes, began), as Keras
    removes its backup directory; one the user made stays.

    No link is followed: a symbolic link as ``backup.pt``,
    ``backup-previous.pt``, ``backup/`` or its ``checkpoint.pt`` (planted
    there, it could lead the resume, the writes and the final deletion
    anywhere) is refused before anything is read.

    ``double_checkpoint=True`` (Keras 3) keeps the previous backup too, as
    ``<backup_dir>/backup-previous.pt``: before each backup, once the last one
    is on disk, it gets that second name (a hard link, so no bytes are
    copied; a copy where the file system has none). When the newest backup
    cannot be read at the start of training -- truncated, empty, garbage, a
    file that carries code or holds names leading outside its directories,
    or missing -- training resumes from the previous one, with a warning
    naming both files, and the next backup leaves the previous one as it
    is. It costs a second file's disk space; each backup waits for the
    previous one's write to end (normally long over), its CPU copy of the
    state is made afresh, and it is written into fresh blocks (the file a
    backup would reuse is the previous backup, which must stay intact).
    Without it an unreadable backup is an error that says which file to
    delete. Single-file backups only: a sharded one (FSDP on several
    processes) is not doubled.

    ``fit`` restores the backup after every callback's ``on_train_begin``, so
    what they reset there is then restored.

    Args:
        backup_dir: directory of the backup file (not empty: ``""`` would
            back up into the working directory).
        save_freq: ``"epoch"`` (at each epoch end) or a positive int: every
            that many optimizer steps (``model.step``), i.e. only after an
            update, never between accumulated batches.
        delete_checkpoint: remove the backup when training ends normally.
        double_checkpoint: keep the previous backup too, and resume from it
            when the newest cannot be read.

    Raises:
        ValueError: ``backup_dir`` is ``None`` or empty (as Keras and Paddle
            refuse it), or ``save_freq`` is neither ``"epoch"`` nor a positive int.
        TypeError: ``backup_dir`` is not a path, or ``double_checkpoint`` not a bool.
        hapi.checkpoint.UnsafeNameError: at ``fit``'s start, a backup's name
            is a symbolic link.
    """

    order = 2  # after every other callback, a resumable ModelCheckpoint too (Callback.order)
    resumable = True  # its files continue a fit (fit warns at once when that cannot be exact)

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        double_checkpoint: bool = False,
    ) -> None:
        super().__init__()
        path_like = isinstance(backup_dir, (str, os.PathLike))
        if not path_like or not os.fspath(backup_dir):
            error = ValueError if path_like or backup_dir is None else TypeError
            must, example = "name a directory", "BackupAndRestore('backup')"
            refuse_argument("BackupAndRestore", "backup_dir", backup_dir, must, example, error)
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            must = "be 'epoch' or a positive number of optimizer steps"
            refuse_argument("BackupAndRestore", "save_freq", save_freq, must, "save_freq=100")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = bool(delete_checkpoint)
        self.double_checkpoint = require_bool(
            "BackupAndRestore", "double_checkpoint", double_checkpoint
        )
        self._last_step = 0
        # Decided at on_train_begin: what this fit may delete at its end.
        self._sharded_backup = False  # a sharded backup was read or written by this fit
        self._made_for_training = False  # backup_dir was absent, or held only a backup
        # The newest backup could not be read: the next backup must not make it the previous.
        self._newest_unreadable = False

    @property
    def path(self) -> str:
        """The backup as ``model.save``/``load`` name it (the file adds ``.pt``)."""
        return os.path.join(self.backup_dir, "backup")

    @property
    def previous_path(self) -> str:
        """The previous backup kept by ``double_checkpoint``, named as :attr:`path` is."""
        return os.path.join(self.backup_dir, "backup-previous")

    def state_dict(self) -> dict:
        # Whether the interrupted run made backup_dir: the directory then holds only the
        # backup, whoever made it, so a resumed run cannot tell by looking.
        return {"made_for_training": self._made_for_training}

    def load_state_dict(self, state: dict) -> None:
        made = state.get("made_for_training", self._made_for_training)  # absent: older backups
        if not isinstance(made, bool):
            refuse_state("BackupAndRestore", "made_for_training", made, "True or False")
        self._made_for_training = made

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Before any backup of this fit: what is there now is not this fit's to delete,
        # unless it is a backup an interrupted run left (backup_dir holds only this
        # callback's names: its backups, their spares and a sharded backup's directory).
        folder = self.backup_dir
        entries = set(os.listdir(folder)) if os.path.isdir(folder) else set()
        own = {"backup"} | {
            os.path.basename(name)
            for file in (self.path + ".pt", self.previous_path + ".pt")
            for name in (file, files.spare_of(file))
        }
        self._made_for_training = not os.path.exists(folder) or bool(entries) and entries <= own
        manifest = os.path.join(self.path, files.MANIFEST)
        for name in (self.path, self.path + ".pt", self.previous_path + ".pt", manifest):
            files.refuse_link(name, "BackupAndRestore: ")  # planted: it could lead anywhere
        self._sharded_backup = os.path.isfile(manifest)
        self._newest_unreadable = False
        if self.double_checkpoint and self.model.sharded and self.is_main:
            warn(
                "BackupAndRestore(double_checkpoint=True): sharded weights (FSDP on several "
                "processes) are backed up as a directory, of which no previous copy is kept.",
            )
        self._last_step = self.model.step

    def restore_backup(self) -> None:
        """Continue from the backup, if there is one: ``fit`` calls it on every process after
        every callback's ``on_train_begin`` and before the first batch.

        Every process asks, and gets the latest backup on any machine: only
        rank 0 writes it, and a restart may have moved rank 0 to a machine
        without one.

        Raises:
            RuntimeError: the backup cannot be read (naming the file to delete
                to start afresh), and with ``double_checkpoint`` the previous
                one neither.
        """
        # The newest backup as it lies on disk, for the messages: its file, or a sharded
        # backup's directory.
        found = [
            name
            for name, kind in ((self.path + ".pt", os.path.isfile), (self.path, os.path.isdir))
            if kind(name)
        ]
        newest, previous = " or ".join(found) or self.path + ".pt", self.previous_path + ".pt"
        scratch = f"To start training from scratch instead, delete {newest}"
        try:
            self.model.load(self.path, resume=True)
            return self._resumed_from(newest)
        except FileNotFoundError:
            failure = None
        except (RuntimeError, ValueError) as error:
            failure = error
            if not self.double_checkpoint:
                raise RuntimeError(
                    f"BackupAndRestore could not resume from {newest}: {error} {scratch}."
                ) from error
        if not self.double_checkpoint:
            return  # no backup: a first run starts from scratch
        # With double_checkpoint: the previous backup, when the newest is unreadable or missing.
        what = "is missing" if failure is None else f"cannot be read ({failure})"
        start = f"BackupAndRestore could not resume: the newest backup {newest} {what}, and"
        try:
            self.model.load(self.previous_path, resume=True)
        except FileNotFoundError:
            if failure is None:
                return  # neither backup: a first run starts from scratch
            raise RuntimeError(
                f"{start} there is no previous backup ({previous} is missing) to fall back on. "
                f"{scratch}."
            ) from failure
        except (RuntimeError, ValueError) as error:
            raise RuntimeError(
                f"{start} the previous backup {previous} cannot be read either ({error}). "
                f"{scratch} and {previous}."
            ) from error
        self._newest_unreadable = True
        if self.is_main:
            warn(
                f"BackupAndRestore: the newest backup {newest} {what}; resuming from the previous "
                f"backup {previous} instead (optimizer step {self.model.step}), so training done "
                f"after it is done again. The next backup replaces {newest}.",
            )
        self._resumed_from(previous)

    def _resumed_from(self, file: str) -> None:
        self._last_step = self.model.step
        if self.is_main:
            tqdm.write(
                f"BackupAndRestore: resuming from {file} at epoch {self.model.epoch + 1}, "
                f"batch {self.model.epoch_step} (optimizer step {self.model.step})."
            )

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        if self.save_freq != "epoch" and stepped_to(self, self.save_freq):
            self._back_up()  # never mid-accumulation: only after an optimizer step

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
        if self.double_checkpoint and not sharded:
            # The last backup's write has ended (collective), so backup.pt is the backup
            # before the one about to be written -- unless it could not be read at the start.
            self.model.wait_for_saves()
            if self.is_main and not self._newest_unreadable:
                files.keep_as_previous(self.path + ".pt", self.previous_path + ".pt")
        self._newest_unreadable = False
        self.model.save(self.path, resumable=True, sharded=sharded, wait=False)

    def on_train_end(self, logs: dict | None = None) -> None:
        # Every process deletes its machine's copy: one left by a rank 0 that a restart
        # moved elsewhere would otherwise "resume" the next, unrelated run.
        self.model.wait_for_saves()  # the last backup's write must not land after the deletion
        if not self.delete_checkpoint:
            return
        files.remove_with_spare(self.path + ".pt")
        if self.double_checkpoint:
            files.remove_with_spare(self.previous_path + ".pt")
        if self._sharded_backup and self.is_main:  # one directory that every process sees
            # Its manifest and shards only: a file of the user's there stays, with the directory.
            files.remove_sharded(self.path)
        if self._made_for_training:
            files.remove_empty_directory(self.backup_dir)
