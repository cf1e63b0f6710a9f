"""The callbacks of one run: their order (the user's, the defaults, ``Callback.order``) and the
hooks' calling conventions."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_data, tiny_model

import hapi
from callbacks import EMA, BackupAndRestore, Callback, CallbackList, History, ModelCheckpoint


class Named(Callback):
    """Notes its name in ``seen`` at on_train_begin, so the run's order can be read."""

    def __init__(self, name: str, seen: list[str]) -> None:
        super().__init__()
        self.name, self.seen = name, seen

    def on_train_begin(self, logs=None):
        self.seen.append(self.name)


def _order_of_a_fit(callbacks: list[Callback], seen: list[str], tmp_path) -> list[str]:
    history = tiny_model().fit(
        make_tiny_data(16), batch_size=8, verbose=2, callbacks=callbacks, save_dir=str(tmp_path)
    )
    assert isinstance(history, History)
    return seen


def test_callbacks_run_in_the_order_given_unless_one_declares_its_order(tmp_path):
    seen: list[str] = []

    class Early(Named):
        order = -5  # a subclass's declared order is obeyed

    class Saver(ModelCheckpoint):
        def on_train_begin(self, logs=None):
            seen.append(f"saver-{self.order}")

    class Backup(BackupAndRestore):
        def on_train_begin(self, logs=None):
            super().on_train_begin(logs)
            seen.append("backup")

    resumable = Saver(str(tmp_path / "r"), resumable=True)
    later = Saver(str(tmp_path / "l"))
    later.resumable = True  # set after construction: its order follows
    callbacks = [
        Backup(str(tmp_path / "b")),
        resumable,
        Named("a", seen),
        later,
        Saver(str(tmp_path / "p")),
        Named("b", seen),
        Early("early", seen),
    ]
    assert _order_of_a_fit(callbacks, seen, tmp_path) == [
        "early",
        "a",
        "saver-0",
        "b",
        "saver-1",
        "saver-1",
        "backup",
    ]


def test_ema_runs_first_whatever_its_place_in_the_list():
    seen: list[str] = []

    class RecordingEMA(EMA):
        def on_train_begin(self, logs=None):
            super().on_train_begin(logs)
            seen.append("ema")

    tiny_model().fit(
        make_tiny_data(16),
        batch_size=8,
        verbose=0,
        callbacks=[Named("a", seen), RecordingEMA(decay=0.9)],
    )
    assert seen == ["ema", "a"]


@pytest.mark.parametrize("order", ["asc", None, True])
def test_an_order_that_is_no_number_is_refused_with_what_it_means(order):
    class Own(Callback):
        def __init__(self):
            super().__init__()
            self.order = order  # a user's own attribute of that name

    with pytest.raises(TypeError, match=r"Own\.order is .*where a callback runs.*another name"):
        tiny_model().fit(make_tiny_data(16), batch_size=8, verbose=0, callbacks=[Own()])


def test_callback_list_hooks_take_the_callbacks_keywords():
    calls = []

    class Keywords(Callback):
        def on_epoch_end(self, epoch, logs=None):
            calls.append(("epoch", epoch, logs))

        def on_train_batch_end(self, step, logs=None):
            calls.append(("step", step, logs))

    cbks = CallbackList([Keywords()])
    cbks.on_epoch_end(epoch=3, logs={"loss": 1.0})
    cbks.on_train_batch_end(step=2)
    cbks.on_train_batch_end(4, {"loss": 0.5})
    assert calls == [("epoch", 3, {"loss": 1.0}), ("step", 2, {}), ("step", 4, {"loss": 0.5})]


def test_a_model_whose_save_takes_paddles_arguments_only_keeps_its_checkpoints(tmp_path):
    """A Model subclass overriding save(path, training=True), the documented signature."""

    class OwnSave(hapi.Model):
        def save(self, path, training=True):
            return super().save(path, training)

    torch.manual_seed(0)
    model = OwnSave(torch.nn.Linear(4, 3))
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.CrossEntropyLoss())
    model.fit(make_tiny_data(16), batch_size=8, verbose=0, save_dir=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.pt", "final.pt"]


def test_an_evaluate_inside_a_fit_with_the_fits_callbacks_leaves_them_in_the_fit():
    """A callback that evaluates with the fit's own EMA and History: the fit's later
    evaluations still use the average, and History still records them as the fit's."""
    data = make_tiny_data(32)

    def run(share_callbacks: bool) -> tuple[list[float], int]:
        ema, history = EMA(decay=0.5), History()

        class Nested(Callback):
            def on_epoch_end(self, epoch, logs=None):
                shared = [ema, history] if share_callbacks else None
                self.model.evaluate(data, batch_size=8, verbose=0, callbacks=shared)

        tiny_model().fit(
            data,
            eval_data=data,
            batch_size=8,
            epochs=3,
            verbose=0,
            callbacks=[ema, history, Nested()],
        )
        return history.history["val_loss"], len(history.evaluations)

    assert run(share_callbacks=True) == run(share_callbacks=False)
