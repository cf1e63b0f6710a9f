"""MonitorCallback: direction, min_delta and the missing-key warning shared by
EarlyStopping, ReduceLROnPlateau and ModelCheckpoint."""

import math
import warnings

import pytest

from callbacks.monitor import MonitorCallback


@pytest.mark.parametrize(
    "monitor, expected",
    [
        ("val_loss", "min"),
        ("loss", "min"),
        ("val_mae", "min"),
        ("val_acc", "max"),
        ("acc_top2", "max"),
        ("val_AUC", "max"),
        ("val_Precision", "max"),
        ("recall", "max"),
        ("f1_macro", "max"),
        ("val_score", "max"),
    ],
)
def test_auto_mode_follows_the_monitored_name(monitor, expected):
    cb = MonitorCallback(monitor=monitor, mode="auto")
    assert cb.mode == expected
    assert cb.best == (math.inf if expected == "min" else -math.inf)


def test_explicit_mode_overrides_the_name():
    assert MonitorCallback(monitor="val_acc", mode="min").mode == "min"
    assert MonitorCallback(monitor="val_loss", mode="max").mode == "max"


def test_min_delta_is_the_smallest_change_that_counts():
    low = MonitorCallback(monitor="val_loss", min_delta=0.1)
    assert not low._is_improvement(0.95, 1.0)
    assert not low._is_improvement(0.9, 1.0)  # a change of exactly min_delta is not enough
    assert low._is_improvement(0.85, 1.0)
    high = MonitorCallback(monitor="val_acc", min_delta=0.1)
    assert not high._is_improvement(0.55, 0.5)
    assert high._is_improvement(0.65, 0.5)


def test_nan_is_never_an_improvement():
    assert not MonitorCallback(mode="min")._is_improvement(math.nan, math.inf)
    assert not MonitorCallback(mode="max")._is_improvement(math.nan, -math.inf)


def test_get_monitor_value_returns_a_float():
    cb = MonitorCallback(monitor="val_loss")
    value = cb.get_monitor_value({"val_loss": 1})
    assert value == 1.0 and isinstance(value, float)


def test_missing_key_warns_once_listing_the_sorted_keys():
    cb = MonitorCallback(monitor="val_accuracy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cb.get_monitor_value({"val_loss": 1.0, "loss": 2.0, "acc": 0.5}) is None
        assert cb.get_monitor_value({"loss": 2.0}) is None
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "'val_accuracy'" in message
    assert "Available keys: ['acc', 'loss', 'val_loss']" in message


@pytest.mark.parametrize("mode", ["median", "auto_", "1", None, 1])
def test_an_unknown_mode_warns_naming_it_and_means_auto(mode):
    # Paddle and Keras warn and fall back to "auto"; the old code raised ValueError.
    with pytest.warns(UserWarning) as caught:
        cb = MonitorCallback(monitor="val_acc", mode=mode)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"mode {mode!r} is unknown; using 'auto'" in message
    assert "accepted: 'auto', 'min', 'max'" in message
    assert cb.mode == "max"  # what "auto" picks for val_acc
    with pytest.warns(UserWarning, match="'x' is unknown"):
        assert MonitorCallback(monitor="val_loss", mode="x").mode == "min"


def test_a_known_mode_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for mode in ("auto", "min", "max"):
            MonitorCallback(mode=mode)


def test_the_warning_points_at_the_callers_line():
    from callbacks.early_stopping import EarlyStopping

    with pytest.warns(UserWarning, match="is unknown") as caught:
        EarlyStopping(mode="auto_")
    assert caught[0].filename == __file__


def test_bad_monitor_and_min_delta_are_refused():
    with pytest.raises(TypeError, match=r"monitor must be .*received 3"):
        MonitorCallback(monitor=3)
    with pytest.raises(ValueError, match=r"min_delta must be a non-negative number; received -0.1"):
        MonitorCallback(min_delta=-0.1)
