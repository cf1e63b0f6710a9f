"""Gradient clipping and the on_before_optimizer_step hook, against a hand-written loop."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyNet, make_tiny_data, tiny_model
from torch import nn

from callbacks import Callback


def _hand_loop(x, y, *, batch, lr, clip_norm=None, clip_value=None, accumulate=1, scale=1.0):
    """The reference: SGD over x/y in order, clipping as torch users write it."""
    torch.manual_seed(0)
    net = TinyNet()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    norms = []
    batches = list(zip(x.split(batch), y.split(batch)))
    for index, (xb, yb) in enumerate(batches):
        (loss_fn(net(xb), yb) * scale / accumulate).backward()
        if (index + 1) % accumulate == 0 or index == len(batches) - 1:
            if clip_norm is not None:
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip_norm)))
            if clip_value is not None:
                torch.nn.utils.clip_grad_value_(net.parameters(), clip_value)
            optimizer.step()
            optimizer.zero_grad()
    return net, norms


def _model(lr=0.5, **prepare):
    return tiny_model(lr, **prepare)


class GradientRecorder(Callback):
    """Copies every gradient the hook sees, and optionally rewrites them."""

    def __init__(self, multiply_by: float | None = None) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, list[torch.Tensor]]] = []  # (step, model.step, grads)
        self.multiply_by = multiply_by

    def on_before_optimizer_step(self, step, logs=None):
        grads = [p.grad.detach().clone() for p in self.model.network.parameters()]
        self.seen.append((step, self.model.step, grads))
        if self.multiply_by is not None:
            for parameter in self.model.network.parameters():
                parameter.grad.mul_(self.multiply_by)


def _max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_clip_grad_norm_equals_a_hand_loop_and_logs_the_norm_before_clipping():
    x, y = make_tiny_data(40)
    history = _model(clip_grad_norm=0.05).fit(
        (x, y), batch_size=10, epochs=1, shuffle=False, verbose=0
    )
    expected, norms = _hand_loop(x, y, batch=10, lr=0.5, clip_norm=0.05)
    model = _model(clip_grad_norm=0.05)
    model.fit((x, y), batch_size=10, epochs=1, shuffle=False, verbose=0)
    assert _max_difference(model.network, expected) < 1e-6
    assert max(norms) > 0.05  # clipping did change the update
    assert history.history["grad_norm"][-1] == pytest.approx(norms[-1], rel=1e-6)


def test_clip_grad_value_equals_a_hand_loop():
    x, y = make_tiny_data(40)
    model = _model(clip_grad_value=0.01)
    model.fit((x, y), batch_size=10, epochs=1, shuffle=False, verbose=0)
    expected, _ = _hand_loop(x, y, batch=10, lr=0.5, clip_value=0.01)
    unclipped, _ = _hand_loop(x, y, batch=10, lr=0.5)
    assert _max_difference(model.network, expected) < 1e-6
    assert _max_difference(model.network, unclipped) > 1e-3


def test_with_accumulation_clipping_and_the_hook_run_once_per_update():
    x, y = make_tiny_data(50)  # 5 batches, groups of 2: updates after batches 1, 3 and 4
    recorder = GradientRecorder()
    model = _model(clip_grad_norm=0.05)
    model.fit(
        (x, y),
        batch_size=10,
        epochs=1,
        shuffle=False,
        verbose=0,
        accumulate_grad_batches=2,
        callbacks=[recorder],
    )
    expected, norms = _hand_loop(x, y, batch=10, lr=0.5, clip_norm=0.05, accumulate=2)
    assert [(step, updates) for step, updates, _ in recorder.seen] == [(1, 0), (3, 1), (4, 2)]
    assert len(norms) == 3
    assert _max_difference(model.network, expected) < 1e-6


def test_the_hook_sees_unclipped_unscaled_gradients_and_can_change_them():
    x, y = make_tiny_data(20)
    recorder = GradientRecorder()
    _model(clip_grad_norm=1e-3).fit(
        (x, y), batch_size=20, epochs=1, shuffle=False, verbose=0, callbacks=[recorder]
    )
    torch.manual_seed(0)
    net = TinyNet()
    nn.CrossEntropyLoss()(net(x), y).backward()
    ((_, _, seen),) = recorder.seen
    for grad, parameter in zip(seen, net.parameters()):
        torch.testing.assert_close(grad, parameter.grad)  # before clipping to 1e-3

    frozen = _model()
    before = [p.detach().clone() for p in frozen.network.parameters()]
    frozen.fit(
        (x, y), batch_size=10, epochs=2, verbose=0, callbacks=[GradientRecorder(multiply_by=0.0)]
    )
    assert all(torch.equal(p, q) for p, q in zip(before, frozen.network.parameters()))


def test_under_fp16_gradients_are_unscaled_before_the_hook_and_clipping():
    x, y = make_tiny_data(20)
    recorder = GradientRecorder()
    model = _model(
        clip_grad_norm=1e6, amp="fp16"
    )  # a bound never reached: only the norm is checked
    history = model.fit((x, y), batch_size=20, epochs=1, verbose=0, callbacks=[recorder])
    ((_, _, seen),) = recorder.seen
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in seen]))
    torch.manual_seed(0)
    net = TinyNet()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.CrossEntropyLoss()(net(x), y)
    loss.backward()
    true_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1e6)
    # The scaler multiplies the loss by 65536 at first: a scaled norm would be far off.
    assert float(norm) == pytest.approx(float(true_norm), rel=1e-2)
    assert history.history["grad_norm"][-1] == pytest.approx(float(norm), rel=1e-5)
