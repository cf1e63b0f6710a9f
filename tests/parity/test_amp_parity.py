"""Paddle's amp and verbose tests, translated (paddle.nn -> torch.nn, InputSpec -> counts).

Sources: Paddle's test/legacy_test/test_hapi_amp.py (TestHapiWithAmp; its static-graph
runs dropped), test_model.py (TestModelFunction.test_accumulate, the amp part) and
test_callbacks.py (TestCallbacks.test_callback_verbose_0..3). Paddle skips the amp
tests without CUDA; torch's float16 autocast and GradScaler("cpu") run them on CPU.
MNIST is replaced by random images of its shape (the tests check mechanics, not
accuracy). Where torch-hapi deliberately differs (Paddle's "O2" and per-op lists have
no torch equivalent), the test asserts torch-hapi's behaviour and says why.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from callbacks.run import callbacks_for_run
from hapi import Model
from hapi.models import LeNet  # Paddle's paddle.vision.models.LeNet


def _mnist_like(n: int = 128, seed: int = 2021):
    """Stand-in for MNIST(mode='train') with Normalize([127.5], [127.5]): values in [-1, 1]."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 1, 28, 28, generator=generator) * 2 - 1
    return images, torch.randint(0, 10, (n,), generator=generator)


def _get_model(amp_config) -> Model:
    """TestHapiWithAmp.get_model: LeNet, Adam(1e-3), CrossEntropyLoss(reduction='sum')."""
    torch.manual_seed(2021)  # paddle.seed(2021)
    model = Model(LeNet(), device="cpu")
    model.prepare(
        optimizer=torch.optim.Adam(model.parameters(), lr=0.001),
        loss=nn.CrossEntropyLoss(reduction="sum"),
        amp_configs=amp_config,
    )
    return model


def _run_model(model: Model, num_iters: int = 2):
    """TestHapiWithAmp.run_model: fit(epochs=1, batch_size=64, num_iters=2, log_freq=1)."""
    return model.fit(
        _mnist_like(), epochs=1, batch_size=64, num_iters=num_iters, log_freq=1, verbose=0
    )


def test_amp():
    """TestHapiWithAmp.test_amp: {'level': 'O1', 'init_loss_scaling': 128} trains."""
    model = _get_model({"level": "O1", "init_loss_scaling": 128})
    history = _run_model(model)
    assert torch.isfinite(torch.tensor(history.history["loss"])).all()
    assert model._scaler.get_scale() == 128.0  # finite steps, far below incr_every_n_steps
    assert model._scaler.state_dict()["_growth_tracker"] == 2  # Paddle's incr_count


def test_fp32():
    """TestHapiWithAmp.test_fp32: {'level': 'O0'} is float32 training, no scaler."""
    model = _get_model({"level": "O0"})
    _run_model(model)
    assert model._amp is None and model._scaler is None


def test_pure_fp16():
    """TestHapiWithAmp.test_pure_fp16: {'level': 'O2', 'init_loss_scaling': 128}.

    Deliberate difference: Paddle casts the network to float16 and keeps float32
    master weights in the optimizer; torch has no such switch, so torch-hapi refuses
    O2 at prepare and points to O1 (autocast) instead of training something else.
    """
    with pytest.raises(ValueError, match=r"pure float16 .* torch has no such switch .* Use 'O1'"):
        _get_model({"level": "O2", "init_loss_scaling": 128})


def test_save_load(tmp_path):
    """TestHapiWithAmp.test_save_load: the scaler's state is saved and loaded with the model."""
    amp_level = {"level": "O1", "init_loss_scaling": 128}
    model = _get_model(amp_level)
    _run_model(model, num_iters=2)
    model.save(tmp_path / "lenet_amp")

    new_model = _get_model(amp_level)
    _run_model(new_model, num_iters=1)
    # not equal before load (Paddle's incr_count is torch's _growth_tracker)
    assert (
        new_model._scaler.state_dict()["_growth_tracker"]
        != model._scaler.state_dict()["_growth_tracker"]
    )
    new_model.load(tmp_path / "lenet_amp")
    # equal after load: the whole scaler state (torch keeps no decr_count: it backs off at once)
    assert new_model._scaler.state_dict() == model._scaler.state_dict()
    conv = model.network.features[3].weight  # Paddle's conv2d_1.w_0
    new_conv = new_model.network.features[3].weight
    torch.testing.assert_close(
        new_model.optimizer.state[new_conv]["exp_avg"], model.optimizer.state[conv]["exp_avg"]
    )  # Paddle's conv2d_1.w_0_moment1_0


def test_dynamic_check_input():
    """TestHapiWithAmp.test_dynamic_check_input: bad configurations raise ValueError.

    Paddle's test wraps the whole list in one assertRaises (so only the first is
    checked); here each must raise. Deliberate differences: Paddle accepts "O2" and
    {'custom_white_list': {'matmul'}, 'init_loss_scaling': 1.0}; torch-hapi refuses
    both at prepare, since torch has no pure-float16 switch and torch.autocast no
    per-op lists -- accepting them would train differently from what was asked.
    """
    model = Model(LeNet(), device="cpu")
    optim = torch.optim.Adam(model.parameters(), lr=0.001)
    loss = nn.CrossEntropyLoss(reduction="sum")
    for amp_configs in [
        {"level": "O3"},
        {"level": "O1", "test": 0},
        {"level": "O1", "use_fp16_guard": True},
        "O3",
    ]:
        with pytest.raises(ValueError):
            model.prepare(optimizer=optim, loss=loss, amp_configs=amp_configs)
    with pytest.raises(ValueError, match="pure float16"):
        model.prepare(optimizer=optim, loss=loss, amp_configs="O2")
    with pytest.raises(ValueError, match="no per-op lists"):
        model.prepare(
            optimizer=optim,
            loss=loss,
            amp_configs={"custom_white_list": {"matmul"}, "init_loss_scaling": 1.0},
        )
    model.prepare(optimizer=optim, loss=loss, amp_configs={"init_loss_scaling": 1.0})  # no list
    assert model._amp == "fp16" and model._scaler.get_scale() == 1.0  # no 'level' means O1


def test_static_check_input():
    """TestHapiWithAmp.test_static_check_input, without the static graph: 'use_pure_fp16' raises."""
    model = Model(LeNet(), device="cpu")
    optim = torch.optim.Adam(model.parameters(), lr=0.001)
    with pytest.raises(ValueError, match="use_pure_fp16"):
        model.prepare(
            optimizer=optim,
            loss=nn.CrossEntropyLoss(reduction="sum"),
            amp_configs={"level": "O2", "use_pure_fp16": True},
        )


class MyModel(nn.Module):
    """test_model.py's MyModel: Linear(20, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self._fc = nn.Linear(20, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fc(x)


def test_accumulate():
    """TestModelFunction.test_accumulate: train_batch(update=False) accumulates, amp None and 'O1'.

    After the update torch-hapi's gradients are None (torch's zero_grad default)
    where Paddle's are zeros.
    """
    data = torch.rand(4, 20)
    label = torch.randint(0, 10, (4,))
    net = MyModel()
    optim = torch.optim.SGD(net.parameters(), lr=0.001)
    for amp_cfg in [None, "O1"]:
        model = Model(net, device="cpu")
        model.prepare(optim, loss=nn.CrossEntropyLoss(reduction="sum"), amp_configs=amp_cfg)
        losses, grads = [], []
        for stat in [False, False, True]:
            losses.append(model.train_batch([data], [label], update=stat)["loss"])
            grads.append([None if p.grad is None else p.grad.clone() for p in net.parameters()])
        for grad1, grad2, grad3 in zip(*grads):
            torch.testing.assert_close(grad1 * 2, grad2)
            assert grad3 is None
        assert losses[0] == pytest.approx(losses[1], abs=1e-4)
        assert losses[0] == pytest.approx(losses[2], abs=1e-4)


# -- TestCallbacks: ProgBarLogger with verbose 0..3 -------------------------------------------


@pytest.fixture
def clock(monkeypatch):
    """Paddle sleeps 5 ms per step; a fake clock advanced by 5 ms gives the same counters, fast."""
    import callbacks.progbar

    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    fake = Clock()
    monkeypatch.setattr(callbacks.progbar, "_clock", fake)
    return fake


@pytest.mark.parametrize("verbose", [0, 1, 2, 3])
def test_callback_verbose(verbose, clock, tmp_path, capsys):
    """TestCallbacks.test_callback_verbose_<0..3> (run_callback): hooks driven with fake logs.

    Paddle's config_callbacks(save_dir=...) is callbacks_for_run(save_dir=...): the
    progress bar, a ModelCheckpoint and History. Paddle only runs it; the output is
    checked here: nothing at 0, lines at 1 (not a terminal) and 2, and at 3 the lines
    carry avg_reader_cost, avg_batch_cost and ips.
    """
    epochs, steps, freq, eval_steps = 2, 5, 2, 2
    lenet = Model(LeNet(), device="cpu")
    lenet.prepare()
    cbks = callbacks_for_run(
        lenet, None, verbose=verbose, log_freq=freq, save_dir=str(tmp_path), save_freq=1
    )
    cbks.set_params(
        {
            "batch_size": 128,
            "epochs": epochs,
            "steps": steps,
            "verbose": verbose,
            "log_freq": freq,
            "metrics": ["loss", "acc"],
            "rank": 0,
            "world_size": 1,
        }
    )

    def step(begin, end, index, logs):
        begin(index, logs)
        clock.now += 0.005  # time.sleep(0.005)
        end(index, logs)

    cbks.on_train_begin()
    logs = {"loss": 50.341673, "acc": 0.00256, "batch_size": 128}
    for epoch in range(epochs):
        cbks.on_epoch_begin(epoch)
        for index in range(steps):
            logs["loss"] -= random.random() * 0.1
            logs["acc"] += random.random() * 0.1
            step(cbks.on_train_batch_begin, cbks.on_train_batch_end, index, logs)
        cbks.on_epoch_end(epoch, logs)

        eval_logs = {"eval_loss": 20.341673, "eval_acc": 0.256}
        cbks.on_eval_begin({"steps": eval_steps, "metrics": ["eval_loss", "eval_acc"]})
        for index in range(eval_steps):
            eval_logs["eval_loss"] -= random.random() * 0.1
            eval_logs["eval_acc"] += random.random() * 0.1
            eval_logs["batch_size"] = 2
            step(cbks.on_eval_batch_begin, cbks.on_eval_batch_end, index, eval_logs)
        cbks.on_eval_end(eval_logs)

        test_logs = {}
        cbks.on_predict_begin({"steps": eval_steps})
        for index in range(eval_steps):
            test_logs["batch_size"] = 2
            step(cbks.on_predict_batch_begin, cbks.on_predict_batch_end, index, test_logs)
        cbks.on_predict_end(test_logs)
    cbks.on_train_end(logs)

    out = capsys.readouterr().out
    assert (tmp_path / "final.pt").exists()  # config_callbacks' ModelCheckpoint
    if verbose == 0:
        assert out == ""
        return
    lines = out.splitlines()
    steps_lines = [line for line in lines if line.startswith("step ")]
    assert [line.split(" - ")[0] for line in steps_lines] == (
        ["step 2/5", "step 4/5", "step 5/5", "step 2/2"] * epochs
    )
    assert "Eval samples: 4" in lines and "Predict samples: 4" in lines
    timed = [line for line in steps_lines if "avg_reader_cost" in line]
    if verbose == 3:
        assert timed == steps_lines
        assert all(
            "avg_reader_cost: 0.00000 sec - avg_batch_cost: 0.00500 sec" in line for line in timed
        )
        assert "ips: 25600.00000 samples/sec" in steps_lines[0]  # 128 samples / 5 ms
        assert "ips: 400.00000 samples/sec" in steps_lines[3]  # evaluation: 2 samples / 5 ms
    else:
        assert timed == []
