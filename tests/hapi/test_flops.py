"""hapi.flops, Model.flops: counts per layer type as Paddle's, custom_ops, a harmless forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hapi
from hapi import Model


@pytest.mark.parametrize(
    ("layer", "size", "expected"),
    [
        # out elements * (in_channels / groups * kernel + bias)
        (nn.Conv1d(4, 6, 3, groups=2), (1, 4, 10), 6 * 8 * (2 * 3 + 1)),
        (nn.Conv3d(2, 3, 2, bias=False), (1, 2, 3, 3, 3), 3 * 8 * (2 * 8)),
        (nn.ConvTranspose2d(2, 4, 3), (1, 2, 5, 5), 4 * 7 * 7 * (2 * 9 + 1)),
        (nn.BatchNorm1d(3), (2, 3, 5), 2 * 30),
        (nn.BatchNorm3d(2), (1, 2, 2, 2, 2), 2 * 16),
        (nn.LeakyReLU(), (2, 7), 14),
        (nn.ReLU6(), (2, 7), 0),
        (nn.Linear(5, 3), (2, 4, 5), 5 * 2 * 4 * 3),  # no bias add, as in Paddle
        (nn.AvgPool2d(2), (1, 3, 4, 4), 3 * 2 * 2),
        (nn.AdaptiveAvgPool1d(2), (1, 3, 8), (4 + 1) * 3 * 2),
        (nn.MaxPool2d(2), (1, 3, 4, 4), 0),
    ],
)
def test_each_layer_type_counts_as_paddle_counts_it(layer, size, expected):
    assert hapi.flops(layer, size) == expected


def test_model_flops_and_the_table(capsys):
    net = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    assert Model(net).flops((1, 4), print_detail=True) == 4 * 8 + 8 * 2
    out = capsys.readouterr().out
    assert "Layer Name" in out and "No count function for GELU" in out
    assert "Total Flops: 48     Total Params: 58" in out


def test_custom_ops_return_or_add_to_total_ops_and_win_over_built_ins():
    net = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Tanh())

    def gelu(m, x, y):
        return 3 * y.numel()

    def tanh(m, x, y):
        m.total_ops += 5
        m.counted_by_user = True  # the function's own attributes stay

    def linear(m, x, y):
        return 1

    total = hapi.flops(net, (2, 4), custom_ops={nn.GELU: gelu, nn.Tanh: tanh, nn.Linear: linear})
    assert total == 1 + 3 * 8 + 5
    assert not any("total_ops" in vars(m) for m in net.modules())
    assert net[2].counted_by_user is True
    net[0].total_ops = 9  # a module's own attribute of that name is left as it was
    hapi.flops(net, (2, 4), custom_ops={nn.Linear: linear})
    assert vars(net[0])["total_ops"] == 9


def test_a_subclass_counts_as_its_base_class():
    class MyConv(nn.Conv2d):
        pass

    assert hapi.flops(MyConv(1, 2, 3, bias=False), (1, 1, 5, 5)) == 2 * 3 * 3 * 9


def test_a_shared_layer_counts_each_call_and_its_parameters_once(capsys):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.unused = nn.Linear(3, 100)

        def forward(self, x):
            return self.fc(self.fc(x))

    assert hapi.flops(Twice(), (1, 3)) == 2 * 9
    assert "Total Params: 12" in capsys.readouterr().out  # the unused layer counts nothing


def test_the_network_keeps_its_modes_statistics_gradients_and_the_rng():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Dropout(0.5))
    net.train()
    net[1].eval()
    before = net[1].running_mean.clone()
    rng = torch.get_rng_state()
    hapi.flops(net, (-1, 1, 5, 5))
    assert [m.training for m in net.modules()] == [True, True, False, True]
    assert torch.equal(net[1].running_mean, before)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in net.parameters())


def test_input_gives_the_tensors_themselves():
    class Keyed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, batch):
            return self.fc(batch["x"])

    assert hapi.flops(Keyed(), input={"x": torch.zeros(4, 3)}) == 3 * 4 * 2


def test_wrong_arguments_say_what_to_pass():
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        hapi.flops("lenet", (1, 3))
    with pytest.raises(ValueError, match="give input_size"):
        hapi.flops(nn.Linear(3, 2))
    with pytest.raises(TypeError, match="custom_ops must map module classes"):
        hapi.flops(nn.Linear(3, 2), (1, 3), custom_ops={"Linear": len})
    with pytest.raises(ValueError, match="only the first"):
        hapi.flops(nn.Linear(3, 2), (-1, -1))
