"""Upstream tests of ModelCheckpoint and BackupAndRestore, translated to torch-hapi.

Sources (read, not copied): Keras 3 ``keras/src/callbacks/model_checkpoint_test.py``
(``test_model_checkpoint_options``), ``keras/src/callbacks/backup_and_restore_test.py``,
and Paddle's ``python/paddle/tests/test_callbacks.py`` (the ModelCheckpoint that
``config_callbacks(save_dir=...)`` adds). Keras' ``filepath`` becomes torch-hapi's
``save_dir`` with its fixed names (``<epoch>.pt``, ``step-<N>.pt``, ``best.pt``,
``final.pt``); Keras' integer ``save_freq`` (batches) becomes ``save_steps`` (optimizer
steps). Where torch-hapi deliberately differs the test asserts torch-hapi's behaviour and
says why (docs/guides/migrating.md, "Where torch-hapi differs from Keras", has the table).
"""

from __future__ import annotations

import os
import warnings

import pytest
from conftest import make_tiny_data, tiny_model

import hapi
from callbacks import BackupAndRestore, Callback, ModelCheckpoint
from hapi.metrics import Accuracy

TRAIN_SAMPLES = 30
BATCH_SIZE = 5


def _model() -> hapi.Model:
    return tiny_model(0.1, [Accuracy()])


def _fit(callbacks, epochs=1, batch_size=BATCH_SIZE, eval_data=True, model=None, **options):
    model = model or _model()
    return model.fit(
        make_tiny_data(TRAIN_SAMPLES),
        eval_data=make_tiny_data(TRAIN_SAMPLES, seed=1) if eval_data else None,
        batch_size=batch_size,
        epochs=epochs,
        verbose=0,
        callbacks=callbacks,
        **options,
    )


# -- Keras model_checkpoint_test.py: test_model_checkpoint_options ------------------------


@pytest.mark.parametrize(
    "monitor, mode", [("val_loss", "auto"), ("val_loss", "min"), ("val_acc", "max")]
)
def test_keras_options_cases_1_to_3_save_every_epoch(tmp_path, monitor, mode):
    """Keras test_model_checkpoint_options, cases 1-3: save_best_only=False saves the epoch."""
    _fit([ModelCheckpoint(tmp_path, monitor=monitor, mode=mode)])
    assert sorted(os.listdir(tmp_path)) == ["0.pt", "best.pt", "final.pt"]


def test_keras_options_case_4_save_best_only(tmp_path):
    """Keras test_model_checkpoint_options, case 4: save_best_only=True on val_acc, max."""
    _fit([ModelCheckpoint(tmp_path, monitor="val_acc", mode="max", save_best_only=True)])
    assert os.listdir(tmp_path) == ["best.pt"]


def test_keras_options_case_5_a_metric_not_available_still_saves(tmp_path):
    """Keras test_model_checkpoint_options, case 5: monitor='unknown', save_best_only=True.

    Keras 3's ModelCheckpoint warns "Can save best model only with unknown available." and
    saves (the stored copy of its test, older, still says the file is not written; the
    callback's code has since changed, and the code is what users get). torch-hapi warns
    once and writes best.pt with the latest weights until the figure is logged.
    """
    with pytest.warns(UserWarning, match=r"'unknown', which is not in the logs"):
        _fit([ModelCheckpoint(tmp_path, monitor="unknown", save_best_only=True)])
    assert os.listdir(tmp_path) == ["best.pt"]


def test_keras_options_case_8_an_integer_save_freq_saves_every_n_steps(tmp_path):
    """Keras test_model_checkpoint_options, case 8a: save_freq=15 with 5 batches an epoch.

    Keras names the files by epoch (3, 6, 9); torch-hapi's save_steps names them by the
    optimizer step (step-15, -30, -45), and writes the epoch files too (save_freq=1).
    """
    _fit([ModelCheckpoint(tmp_path, save_steps=15)], epochs=10, batch_size=6)
    names = set(os.listdir(tmp_path))
    assert {"step-15.pt", "step-30.pt", "step-45.pt"} <= names
    assert not {"step-5.pt", "step-10.pt", "step-20.pt", "step-50.pt"} & names


def test_keras_options_case_9_an_invalid_save_freq_is_an_error(tmp_path):
    """Keras test_model_checkpoint_options, case 9: save_freq='invalid_save_freq'."""
    with pytest.raises(ValueError, match=r"save_freq must be a positive int"):
        ModelCheckpoint(tmp_path, save_freq="invalid_save_freq")
    ModelCheckpoint(tmp_path, save_freq=3)  # valid: no error


# -- Paddle test_callbacks.py: the ModelCheckpoint of config_callbacks(save_dir=...) ----------


def test_paddle_save_dir_writes_each_epoch_and_final(tmp_path):
    """Paddle TestCallbacks.run_callback: save_dir adds ModelCheckpoint(save_freq=1): files
    named by the 0-based epoch, and 'final' at the end."""
    _model().fit(
        make_tiny_data(TRAIN_SAMPLES),
        batch_size=BATCH_SIZE,
        epochs=2,
        verbose=0,
        save_dir=str(tmp_path),
    )
    assert sorted(os.listdir(tmp_path)) == ["0.pt", "1.pt", "final.pt"]


# -- Keras backup_and_restore_test.py -----------------------------------------------------


class _Interrupt(Callback):
    """Keras' InterruptingCallback: raises once ``steps`` batches or ``epochs`` epochs are done.

    Keras raises at the end of that batch or epoch, after the backup callback listed
    before it saved; torch-hapi runs BackupAndRestore after every other callback, so the
    raise waits for the start of the next batch or epoch, when that backup is made.
    """

    def __init__(self, steps=None, epochs=None) -> None:
        super().__init__()
        self.steps, self.epochs, self.batches = steps, epochs, 0

    def on_train_batch_begin(self, step, logs=None):
        if self.batches == self.steps:
            raise RuntimeError("StepsInterruption")
        self.batches += 1

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epochs:
            raise RuntimeError("EpochInterruption")


class _Count(Callback):
    """Keras' CanaryLayer: how many training batches ran, over both fits."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def on_train_batch_begin(self, step, logs=None):
        self.batches += 1


def _backup_fit(model, callbacks, epochs):
    return model.fit(
        make_tiny_data(10), batch_size=4, epochs=epochs, verbose=0, callbacks=callbacks
    )


@pytest.mark.parametrize("save_freq", ["batch", 0.15])
def test_keras_save_freq_unknown_error(tmp_path, save_freq):
    """Keras test_save_freq_unknown_error."""
    with pytest.raises(ValueError, match=r"save_freq must be 'epoch' or a positive number"):
        BackupAndRestore(tmp_path / "backup_dir", save_freq=save_freq)


def test_keras_best_case_step(tmp_path):
    """Keras test_best_case_step: save_freq=1, interrupted after 2 batches, then 5 epochs.

    Keras restarts the interrupted epoch from its first batch (17 batches in all);
    torch-hapi resumes at the batch after the backup, so 2 + 13 = 15 batches run: the
    same training as an uninterrupted run of 5 epochs of 3 batches.
    """
    backup_dir = tmp_path / "subdir"
    model, count = _model(), _Count()
    backup = BackupAndRestore(backup_dir, save_freq=1)
    with pytest.raises(RuntimeError, match="StepsInterruption"):
        _backup_fit(model, [_Interrupt(steps=2), count, backup], epochs=2)
    model.wait_for_saves()
    assert backup_dir.exists()
    assert count.batches == 2
    history = _backup_fit(model, [_Interrupt(), count, backup], epochs=5)
    assert history.epoch[-1] == 4
    assert count.batches == 15
    assert model.epoch == 5


def test_keras_best_case_epoch(tmp_path):
    """Keras test_best_case_epoch: interrupted at the end of epoch 2, then 5 epochs in all."""
    backup_dir = tmp_path / "subdir"
    model, count = _model(), _Count()
    backup = BackupAndRestore(backup_dir, save_freq="epoch")
    with pytest.raises(RuntimeError, match="EpochInterruption"):
        _backup_fit(model, [_Interrupt(epochs=2), count, backup], epochs=6)
    assert backup_dir.exists()
    assert count.batches == 6
    history = _backup_fit(model, [_Interrupt(), count, backup], epochs=5)
    assert history.epoch[-1] == 4
    assert count.batches == 5 * 3


def test_keras_backup_corrupted(tmp_path):
    """Keras test_backup_corrupted: the newest backup overwritten with "0"; the previous one
    is loaded. Keras 3 keeps the previous backup with double_checkpoint=True, as here."""
    backup_dir = tmp_path / "subdir"
    model, count = _model(), _Count()
    backup = BackupAndRestore(backup_dir, save_freq="epoch", double_checkpoint=True)
    with pytest.raises(RuntimeError, match="EpochInterruption"):
        _backup_fit(model, [_Interrupt(epochs=2), count, backup], epochs=6)
    model.wait_for_saves()
    assert (backup_dir / "backup.pt").exists() and (backup_dir / "backup-previous.pt").exists()
    assert count.batches == 6
    (backup_dir / "backup.pt").write_text("0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _backup_fit(model, [_Interrupt(), count, backup], epochs=5)
    assert any("resuming from the previous backup" in str(w.message) for w in caught)
    assert history.epoch[-1] == 4
    # Resumed after epoch 1 (the previous backup): epochs 1-4 run again, 4 * 3 batches.
    assert count.batches == 6 + 4 * 3


def test_keras_model_deleted_case_epoch(tmp_path):
    """Keras test_model_deleted_case_epoch: a finished fit leaves no backup directory."""
    backup_dir = tmp_path / "subdir"
    _backup_fit(_model(), [BackupAndRestore(backup_dir, save_freq="epoch")], epochs=2)
    assert not backup_dir.exists()


@pytest.mark.parametrize("backup_dir", ["", None])
def test_keras_backup_dir_empty_or_none_error(backup_dir):
    """Keras test_backup_dir_empty_error and test_backup_dir_none_error."""
    with pytest.raises(ValueError, match=r"backup_dir must name a directory"):
        BackupAndRestore(backup_dir=backup_dir, save_freq="epoch")
