"""The exact order of hooks and the logs each one receives."""

from __future__ import annotations

from conftest import make_tiny_data, tiny_model

from hapi.metrics import Accuracy

FIGURES = ("acc", "loss")


def _model():
    return tiny_model(0.1, Accuracy())


def test_fit_calls_hooks_in_keras_order_with_the_documented_logs(recorder):
    x, y = make_tiny_data(20)
    _model().fit(
        (x, y),
        eval_data=(x[:10], y[:10]),
        batch_size=10,
        epochs=2,
        log_freq=1,
        verbose=0,
        callbacks=[recorder],
    )
    batch = ("acc", "batch_size", "loss", "samples")
    val = ("acc", "loss", "val_acc", "val_loss")
    epoch = [
        ("on_train_batch_begin", 0, ()),
        ("on_before_optimizer_step", 0, ()),
        ("on_train_batch_end", 0, batch),
        ("on_train_batch_begin", 1, ()),
        ("on_before_optimizer_step", 1, ()),
        ("on_train_batch_end", 1, batch),
        ("on_eval_begin", None, ("metrics", "steps")),
        ("on_eval_batch_begin", 0, ()),
        ("on_eval_batch_end", 0, batch),
        ("on_eval_end", None, FIGURES),
    ]
    assert recorder.calls == [
        ("on_train_begin", None, ()),
        ("on_epoch_begin", 0, ()),
        *epoch,
        ("on_epoch_end", 0, val),
        ("on_epoch_begin", 1, ()),
        *epoch,
        ("on_epoch_end", 1, val),
        ("on_train_end", None, val),
    ]


def test_batch_logs_carry_figures_only_every_log_freq_steps_and_at_the_end(recorder):
    x, y = make_tiny_data(70)
    _model().fit((x, y), batch_size=10, log_freq=3, verbose=0, callbacks=[recorder])
    with_figures = [c[1] for c in recorder.calls if c[0] == "on_train_batch_end" and "loss" in c[2]]
    assert with_figures == [2, 5, 6]  # steps 3 and 6, and the last (7th)


def test_evaluate_and_predict_hooks(recorder):
    x, y = make_tiny_data(15)
    model = _model()
    model.evaluate((x, y), batch_size=10, verbose=0, callbacks=[recorder])
    model.predict((x, y), batch_size=10, verbose=0, callbacks=[recorder])
    assert recorder.calls == [
        ("on_eval_begin", None, ("metrics", "steps")),
        ("on_eval_batch_begin", 0, ()),
        ("on_eval_batch_end", 0, ("batch_size",)),
        ("on_eval_batch_begin", 1, ()),
        ("on_eval_batch_end", 1, ("acc", "batch_size", "loss", "samples")),
        ("on_eval_end", None, FIGURES),
        ("on_predict_begin", None, ("steps",)),
        ("on_predict_batch_begin", 0, ()),
        ("on_predict_batch_end", 0, ("batch_size",)),
        ("on_predict_batch_begin", 1, ()),
        ("on_predict_batch_end", 1, ("batch_size",)),
        ("on_predict_end", None, ()),
    ]


def test_params_describe_the_run(recorder):
    x, y = make_tiny_data(30)
    _model().fit((x, y), batch_size=8, epochs=3, log_freq=5, verbose=0, callbacks=[recorder])
    assert recorder.params == {
        "epochs": 3,
        "steps": 4,
        "batch_size": 8,
        "verbose": 0,
        "log_freq": 5,
        "metrics": ["loss", "acc"],
        "rank": 0,
        "world_size": 1,
        "eval_steps": None,
        "accumulate_grad_batches": 1,
        "num_iters": None,
    }


def test_a_loader_on_a_batch_sampler_reports_its_batch_size_and_reshuffles(recorder):
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

    x, y = make_tiny_data(32)
    seen = []

    class Recording(DistributedSampler):
        def __iter__(self):
            order = list(super().__iter__())
            seen.append(order)
            return iter(order)

    inner = Recording(TensorDataset(x, y), num_replicas=1, rank=0, shuffle=True)
    loader = DataLoader(TensorDataset(x, y), batch_sampler=BatchSampler(inner, 8, drop_last=False))
    _model().fit(loader, epochs=2, verbose=0, callbacks=[recorder])
    assert recorder.params["batch_size"] == 8  # not None: read from the batch sampler
    assert len(seen) == 2 and sorted(seen[0]) == sorted(seen[1]) == list(range(32))
    assert seen[0] != seen[1]  # fit's set_epoch reached the sampler inside: a new order


def test_a_callback_mutating_logs_does_not_affect_the_next(recorder):
    from callbacks import Callback

    class Vandal(Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs.clear()

    x, y = make_tiny_data(20)
    history = _model().fit((x, y), batch_size=10, verbose=0, callbacks=[Vandal(), recorder])
    assert history.history["loss"]
    assert [c for c in recorder.calls if c[0] == "on_epoch_end"][0][2] == FIGURES
