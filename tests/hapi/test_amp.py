"""prepare(amp=...) takes Paddle's amp configuration: levels and amp_configs dicts.

What maps onto torch (autocast's dtype, GradScaler's init_scale / growth_factor /
backoff_factor / growth_interval, a fixed scale) must reach the objects that train;
what does not (O2, per-op lists, ...) must fail at prepare with a message that says
why and what to use instead. Everything runs on CPU: torch's GradScaler("cpu")
and float16 autocast on CPU train end to end.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TinyNet, make_tiny_data, tiny_model
from torch import nn

from hapi import Model
from hapi.amp import FixedScaleGradScaler, parse_amp

PADDLE_CONFIG = {
    "level": "O1",
    "init_loss_scaling": 128,
    "incr_ratio": 4.0,
    "decr_ratio": 0.25,
    "incr_every_n_steps": 3,
}


def _model(amp=None, lr=0.5, **prepare):
    return tiny_model(lr, amp=amp, device="cpu", **prepare)


def _hand_loop(x, y, scaler: torch.amp.GradScaler, batch: int = 10, lr: float = 0.5) -> nn.Module:
    """What a torch user writes for Paddle's O1: float16 autocast and a GradScaler."""
    torch.manual_seed(0)
    net = TinyNet()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    for xb, yb in zip(x.split(batch), y.split(batch)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(net(xb), yb)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return net


def test_a_paddle_config_trains_like_a_hand_loop_with_the_same_scaler():
    x, y = make_tiny_data(40)
    model = _model(PADDLE_CONFIG)
    model.fit((x, y), batch_size=10, shuffle=False, verbose=0)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=128, growth_factor=4.0, backoff_factor=0.25, growth_interval=3
    )
    expected = _hand_loop(x, y, scaler)
    for trained, reference in zip(model.network.parameters(), expected.parameters()):
        torch.testing.assert_close(trained, reference, atol=1e-6, rtol=0)
    # 4 finite steps: grown once by incr_ratio after incr_every_n_steps=3, one step counted since
    assert model._scaler.state_dict() == {
        "scale": 512.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 3,
        "_growth_tracker": 1,
    }
    assert scaler.state_dict() == model._scaler.state_dict()
    assert all(p.dtype == torch.float32 for p in model.network.parameters())  # O1: fp32 weights


def test_o1_is_fp16_with_torchs_defaults_which_are_paddles():
    for amp in ("O1", {"level": "O1"}, {"init_loss_scaling": 65536.0}):
        model = _model(amp)
        assert model._amp == "fp16"
        assert type(model._scaler) is torch.amp.GradScaler
        assert model._scaler.state_dict() == {
            "scale": 65536.0,  # Paddle's GradScaler: 2**16, 2.0, 0.5, 2000, back off every inf step
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "_growth_tracker": 0,
        }


@pytest.mark.parametrize(
    "amp",
    ["O0", {"level": "O0"}, {}, {"level": "O0", "init_loss_scaling": 128}],
    ids=["O0", "dict-O0", "empty-dict", "O0-ignores-scaler-keys"],
)
def test_o0_trains_in_float32(amp):
    model = _model(amp)
    assert model._amp is None and model._scaler is None


def _autocast_dtypes(model: Model, x, y) -> set[torch.dtype]:
    seen: set[torch.dtype] = set()
    model.network.hidden.register_forward_hook(lambda module, args, out: seen.add(out.dtype))
    model.fit((x, y), batch_size=10, verbose=0)
    return seen


def test_dtype_reaches_autocast():
    x, y = make_tiny_data(20)
    assert _autocast_dtypes(_model({"level": "O1"}), x, y) == {torch.float16}
    bf16 = _model({"level": "O1", "dtype": "bfloat16"})
    assert bf16._amp == "bf16" and bf16._scaler is None  # bfloat16 needs no loss scaling
    assert _autocast_dtypes(bf16, x, y) == {torch.bfloat16}


def test_a_fixed_scale_never_moves_and_still_trains():
    x, y = make_tiny_data(40)
    model = _model(
        {"init_loss_scaling": 8, "incr_every_n_steps": 1, "use_dynamic_loss_scaling": False}
    )
    assert isinstance(model._scaler, FixedScaleGradScaler)
    before = [p.clone() for p in model.network.parameters()]
    model.fit((x, y), batch_size=10, verbose=0)
    assert model._scaler.get_scale() == 8.0  # dynamic, incr_every_n_steps=1 would give 8 * 2**4
    assert all(not torch.equal(a, b) for a, b in zip(before, model.network.parameters()))


@pytest.mark.parametrize("dynamic, final_scale", [(True, 2.0**116), (False, 2.0**120)])
def test_overflowing_steps_are_skipped_and_only_a_dynamic_scale_backs_off(dynamic, final_scale):
    # 2**120 overflows float16 in backward: every step finds inf gradients
    x, y = make_tiny_data(40)
    model = _model({"init_loss_scaling": 2.0**120, "use_dynamic_loss_scaling": dynamic})
    before = [p.clone() for p in model.network.parameters()]
    model.fit((x, y), batch_size=10, verbose=0)
    assert model._scaler.get_scale() == final_scale  # 4 steps, decr_ratio 0.5 each when dynamic
    assert all(torch.equal(a, b) for a, b in zip(before, model.network.parameters()))


def test_amp_configs_is_paddles_name_for_amp():
    model = _model(amp_configs={"level": "O1", "init_loss_scaling": 64})
    assert model._amp == "fp16" and model._scaler.get_scale() == 64.0
    with pytest.raises(ValueError, match=r"amp_configs is Paddle's name for amp: pass one"):
        _model("fp16", amp_configs="O1")


def test_the_short_names_still_work():
    assert parse_amp(None).name is None
    assert parse_amp("bf16").name == "bf16" and parse_amp("bf16").scaler_options == {}
    assert parse_amp("fp16").name == "fp16" and parse_amp("fp16").dynamic_scaling


@pytest.mark.parametrize(
    "amp, message",
    [
        ("O2", r"amp='O2' is Paddle's pure float16 .* torch has no such switch .* Use 'O1'"),
        ({"level": "O2"}, r"amp\['level'\]='O2' is Paddle's pure float16"),
        ({"level": "O3"}, r"amp\['level'\] must be 'O0', 'O1' or 'O2' .*; received 'O3'"),
        ("O3", r"amp must be None, 'bf16' or 'fp16'; received 'O3'\. .* Paddle's levels"),
        ({"level": "O1", "test": 0}, r"amp has unknown key\(s\) \['test'\]\. Accepted keys"),
        ({"level": "O0", "tset": 0}, r"unknown key\(s\) \['tset'\]"),
        ({"level": "O1", "use_fp16_guard": True}, r"use_fp16_guard'\] belongs to Paddle's static"),
        ({"use_pure_fp16": True}, r"'use_pure_fp16'\] is not a key: .* the level alone"),
        (
            {"custom_white_list": {"matmul"}},
            r"custom_white_list'\]=\{'matmul'\}: torch\.autocast has no per-op lists.*enabled=False",
        ),
        ({"custom_black_list": ["softmax"]}, r"custom_black_list'\].*no per-op lists"),
        ({"decr_every_n_nan_or_inf": 2}, r"=2: torch\.amp\.GradScaler shrinks the scale at every"),
        ({"dtype": "bfloat16", "incr_ratio": 3.0}, r"'bfloat16' and loss-scaling key\(s\)"),
        ({"dtype": "float32"}, r"amp\['dtype'\] must be 'float16' or 'bfloat16'; received"),
        ({"init_loss_scaling": 0}, r"init_loss_scaling'\] must be a positive finite number"),
        ({"init_loss_scaling": "1024"}, r"init_loss_scaling'\] must be a number; received '1024'"),
        ({"incr_ratio": 1.0}, r"incr_ratio'\] must be greater than 1"),
        ({"decr_ratio": 1.5}, r"decr_ratio'\] must be between 0 and 1"),
        ({"incr_every_n_steps": 0}, r"incr_every_n_steps'\] must be a positive int"),
        ({"use_dynamic_loss_scaling": "no"}, r"use_dynamic_loss_scaling'\] must be True or False"),
        (["O1"], r"amp must be None, 'bf16' or 'fp16'; received \['O1'\]"),
    ],
)
def test_what_torch_cannot_honour_fails_at_prepare_and_says_what_to_do(amp, message):
    model = _model()
    with pytest.raises(ValueError, match=message):
        model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), amp=amp)
    assert model._amp is None and model._scaler is None  # the failed prepare changed nothing
