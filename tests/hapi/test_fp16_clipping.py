"""fp16 with gradient clipping and no callback: gradients are unscaled before they are clipped.

tests/hapi/test_clipping.py checks fp16 clipping with an on_before_optimizer_step
callback, which forces the unscale on its own. Without one, clipping alone
must ask for it: clipping the scaled gradients (x65536 at first) reports a
norm 65536 times too large and shrinks every update by as much.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from torch import nn

from hapi import Model

CLIP = 0.05


def _hand_loop(x, y, batch: int, lr: float) -> tuple[nn.Module, list[float]]:
    """What a torch user writes: autocast, GradScaler, unscale_, clip_grad_norm_, scaler.step."""
    torch.manual_seed(0)
    net = TinyNet()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu")
    loss_fn = nn.CrossEntropyLoss()
    norms = []
    for xb, yb in zip(x.split(batch), y.split(batch)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(net(xb), yb)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return net, norms


def test_fp16_clipping_without_a_callback_equals_a_hand_loop():
    x, y = make_tiny_data(40)
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.5),
        nn.CrossEntropyLoss(),
        amp="fp16",
        clip_grad_norm=CLIP,
    )
    history = model.fit((x, y), batch_size=10, epochs=1, shuffle=False, verbose=0)
    expected, norms = _hand_loop(x, y, batch=10, lr=0.5)
    assert min(norms) > CLIP  # every update was clipped: the clip decides the step
    assert max(norms) < 10  # true norms; scaled ones would be ~65536 times larger
    assert history.history["grad_norm"][-1] == pytest.approx(norms[-1], rel=1e-3)
    for trained, reference in zip(model.network.parameters(), expected.parameters()):
        torch.testing.assert_close(trained, reference, atol=1e-5, rtol=0)
    torch.manual_seed(0)
    untrained = TinyNet()
    moved = max(
        (p - q).abs().max().item() for p, q in zip(expected.parameters(), untrained.parameters())
    )
    assert moved > 1e-3  # clipping scaled gradients would leave updates ~65536 times smaller
