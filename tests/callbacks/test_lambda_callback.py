"""LambdaCallback: functions per hook, called positionally; hooks not given cost the loop nothing."""

from __future__ import annotations

import pytest
from conftest import make_tiny_data, tiny_model

from callbacks import Callback, CallbackList, LambdaCallback
from callbacks.base import HOOKS
from hapi import Model

DATA = make_tiny_data(20)


def _model() -> Model:
    return tiny_model(0.05)


def test_only_the_hooks_given_are_dispatched():
    cb = LambdaCallback(on_epoch_end=lambda epoch, logs: None)
    cbks = CallbackList([cb])
    assert [hook for hook in HOOKS if cbks.wants(hook)] == ["on_epoch_end"]
    # no function at all: no hook
    assert not any(CallbackList([LambdaCallback()]).wants(hook) for hook in HOOKS)


def test_functions_get_the_hooks_arguments_positionally():
    calls = []
    cb = LambdaCallback(
        on_train_begin=lambda lg: calls.append(("train_begin", lg)),  # any parameter names
        on_epoch_begin=lambda e, lg: calls.append(("epoch_begin", e, lg)),
        on_train_batch_end=lambda s, lg: calls.append(("batch_end", s, lg)),
        on_eval_end=lambda lg: calls.append(("eval_end", lg)),
    )
    cbks = CallbackList([cb])
    cbks.on_train_begin()
    cbks.on_epoch_begin(3)
    cbks.on_train_batch_end(1, {"loss": 0.5})
    cbks.on_eval_end({"loss": 0.25})
    assert calls == [
        ("train_begin", {}),
        ("epoch_begin", 3, {}),
        ("batch_end", 1, {"loss": 0.5}),
        ("eval_end", {"loss": 0.25}),
    ]


def test_a_fit_calls_each_given_hook_in_order():
    calls = []
    cb = LambdaCallback(
        on_train_begin=lambda logs: calls.append("train_begin"),
        on_epoch_begin=lambda epoch, logs: calls.append(f"epoch_begin {epoch}"),
        on_epoch_end=lambda epoch, logs: calls.append(f"epoch_end {epoch} {sorted(logs)}"),
        on_train_end=lambda logs: calls.append("train_end"),
    )
    _model().fit(DATA, eval_data=DATA, batch_size=10, epochs=2, verbose=0, callbacks=[cb])
    assert calls == [
        "train_begin",
        "epoch_begin 0",
        "epoch_end 0 ['loss', 'val_loss']",
        "epoch_begin 1",
        "epoch_end 1 ['loss', 'val_loss']",
        "train_end",
    ]


def test_batch_hooks_in_a_fit():
    steps = []
    cb = LambdaCallback(
        on_train_batch_begin=lambda step, logs: steps.append(("begin", step)),
        on_train_batch_end=lambda step, logs: steps.append(("end", step)),
    )
    _model().fit(DATA, batch_size=10, epochs=1, verbose=0, callbacks=[cb])
    assert steps == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1)]


def test_keras_test_names_mean_evaluation_and_predict_hooks_work():
    seen = []
    model = _model()
    cb = LambdaCallback(
        on_test_begin=lambda logs: seen.append("eval_begin"),
        on_test_batch_end=lambda step, logs: seen.append(f"eval_batch {step}"),
        on_predict_begin=lambda logs: seen.append("predict_begin"),
        on_predict_end=lambda logs: seen.append("predict_end"),
    )
    model.evaluate(DATA, batch_size=10, verbose=0, callbacks=[cb])
    model.predict((DATA[0],), batch_size=20, verbose=0, callbacks=[cb])
    assert seen == ["eval_begin", "eval_batch 0", "eval_batch 1", "predict_begin", "predict_end"]


def test_keras_old_batch_names_mean_the_training_batch_hooks():
    steps = []
    cb = LambdaCallback(on_batch_end=lambda step, logs: steps.append(step))
    CallbackList([cb]).on_train_batch_end(4, {})
    assert steps == [4]


def test_other_keywords_become_attributes_as_in_keras():
    def custom(logs):
        return None

    cb = LambdaCallback(custom_method=custom, note="x")
    assert cb.custom_method is custom and cb.note == "x"
    assert not any(CallbackList([cb]).wants(hook) for hook in HOOKS)


def test_mistakes_are_type_errors_naming_them():
    with pytest.raises(TypeError, match=r"received on_epoch_ends=, which is no callback hook"):
        LambdaCallback(on_epoch_ends=lambda epoch, logs: None)
    with pytest.raises(TypeError, match=r"on_epoch_end must be a function; received 3 of type int"):
        LambdaCallback(on_epoch_end=3)
    with pytest.raises(TypeError, match=r"two functions for on_eval_end \(on_test_end= is another"):
        LambdaCallback(on_eval_end=print, on_test_end=print)


def test_a_function_that_raises_stops_the_fit():
    def boom(epoch, logs):
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        _model().fit(DATA, batch_size=10, epochs=2, verbose=0, callbacks=[LambdaCallback(boom)])


def test_it_is_a_callback_the_model_and_params_reach():
    seen = []
    cb = LambdaCallback(on_train_begin=lambda logs: seen.append(cb.params["epochs"]))
    assert isinstance(cb, Callback)
    _model().fit(DATA, batch_size=10, epochs=2, verbose=0, callbacks=[cb])
    assert seen == [2] and cb.model is not None
