"""Paddle's summary and flops tests, translated (paddle.nn -> torch.nn, static-graph cases dropped).

Sources: Paddle test/legacy_test/test_model.py (TestModelFunction.test_summary*,
test_dynamic_flops*, TestModel.test_summary_gpu) and the examples in the docstrings of
python/paddle/hapi/model_summary.py and dynamic_flops.py, whose printed totals are asserted
here, computed by hand. Paddle's time_major=False RNNs are torch's batch_first=True ones.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hapi
from hapi import Model
from hapi.models import LeNet

LENET_PARAMS = (1 * 6 * 3 * 3 + 6) + (6 * 16 * 5 * 5 + 16) + (400 * 120 + 120) + (120 * 84 + 84)
LENET_PARAMS += 84 * 10 + 10  # = 61,610, Paddle's docstring total


def state_numel(net: nn.Module) -> int:
    return sum(t.numel() for t in net.state_dict().values())


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self._fc = nn.Linear(20, 10)

    def forward(self, x):
        return self._fc(x)


class ModelInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        return self.fc(x), 0


class ModelOuter(nn.Module):
    def __init__(self):
        super().__init__()
        self.module1 = ModelInner()
        self.module2 = nn.Linear(4, 5)

    def forward(self, x):
        y, _ = self.module1(x)
        return self.module2(y), 3


class LeNetListInput(LeNet):
    """Paddle's: the first conv frozen, inputs in one list."""

    def __init__(self):
        super().__init__()
        for param in self.features[0].parameters():
            param.requires_grad = False

    def forward(self, inputs):
        x = torch.flatten(self.features(inputs[0]), 1)
        return self.fc(x + inputs[1])


class LeNetDictInput(LeNet):
    def forward(self, inputs):
        x = torch.flatten(self.features(inputs["x1"]), 1)
        return self.fc(x + inputs["x2"])


class LeNetMultiInput(LeNet):
    def forward(self, inputs, y):
        return self.fc(torch.flatten(self.features(inputs), 1) + y)


def test_summary(capsys):
    """TestModelFunction.test_summary: totals without input, then input_size=(20), [(20)], dtype.

    Paddle's Model.summary() with no input_size uses the Model's InputSpecs; torch-hapi's
    Model has none, and prints the parameter counts alone (SPEC).
    """
    net = MyModel()
    model = Model(net)
    assert model.summary()["total_params"] == state_numel(net) == 20 * 10 + 10
    for kwargs in (
        {"input_size": (20)},
        {"input_size": [(20)]},
        {"input_size": (20), "dtype": "float32"},
    ):
        capsys.readouterr()
        assert model.summary(**kwargs) == {"total_params": 210, "trainable_params": 210}
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("_fc"))
        assert row.split()[2:5] == ["[20]", "[10]", "210"]  # an int n is the shape (n,): no batch


def test_summary_non_tensor(capsys):
    """TestModelFunction.test_summary_non_tensor: layers and a network that return non-tensors."""
    info = Model(ModelOuter()).summary(input_size=(-1, 3))
    assert info["total_params"] == (3 * 4 + 4) + (4 * 5 + 5)
    rows = {
        line.split()[0]: line.split()[2:] for line in capsys.readouterr().out.splitlines() if line
    }
    assert rows["module1.fc"][:4] == ["[1,", "3]", "[1,", "4]"]  # input and output shapes
    assert rows["module2"][:4] == ["[1,", "4]", "[1,", "5]"]


def test_summary_nlp():
    """TestModelFunction.test_summary_nlp (and TestModel.test_summary_gpu's LSTM).

    Paddle asserts half its state_dict's size because its RNN state_dict holds every weight
    twice; torch's holds each once, so here the total is the state_dict's size.
    """
    nlp_net = nn.GRU(
        input_size=2, hidden_size=3, num_layers=3, bidirectional=True, batch_first=True
    )
    assert Model(nlp_net).summary((1, 1, 2))["total_params"] == state_numel(nlp_net)

    rnn = nn.LSTM(16, 32, 2, batch_first=True)
    info = Model(rnn).summary([(-1, 23, 16), ((2, None, 32), (2, -1, 32))])
    assert info["total_params"] == state_numel(rnn)

    rnn = nn.GRU(16, 32, 2, bidirectional=True, batch_first=True)
    assert Model(rnn).summary((4, 23, 16))["total_params"] == state_numel(rnn)

    rnn = nn.RNN(16, 32, 2, bidirectional=True, batch_first=True)
    assert Model(rnn).summary((4, 23, 16))["total_params"] == state_numel(rnn)


def test_summary_input(capsys):
    """TestModelFunction.test_summary_input: input= a tensor, a list of tensors, a dict."""
    assert Model(MyModel()).summary(input=torch.rand(1, 20))["total_params"] == 210

    rnn = nn.RNN(16, 32, 2, bidirectional=True, batch_first=True)
    Model(rnn).summary(input=torch.rand(4, 23, 16))
    assert "[4, 23, 64]" in capsys.readouterr().out

    info = Model(LeNetListInput()).summary(input=[torch.rand(1, 1, 28, 28), torch.rand(1, 400)])
    assert info == {"total_params": LENET_PARAMS, "trainable_params": LENET_PARAMS - (54 + 6)}

    inputs = {"x1": torch.rand(1, 1, 28, 28), "x2": torch.rand(1, 400)}
    assert Model(LeNetDictInput()).summary(input=inputs)["total_params"] == LENET_PARAMS


def test_summary_dtype(capsys):
    """TestModelFunction.test_summary_dtype: an Embedding fed int64 of shape (3, 1)."""
    Model(nn.Embedding(10, 3)).summary((3, 1), dtype="int64")
    assert "[3, 1, 3]" in capsys.readouterr().out


def test_summary_error():
    """TestModelFunction.test_summary_error: a str size is a TypeError, (-1, -1) a ValueError."""
    nlp_net = nn.GRU(input_size=2, hidden_size=3, num_layers=3, batch_first=True)
    with pytest.raises(TypeError):
        Model(nlp_net).summary((1, 1, "2"))
    with pytest.raises(ValueError):
        Model(nlp_net).summary((-1, -1))
    Model(nlp_net).summary((1, 1, 2))


def test_summary_docstring_examples(capsys):
    """model_summary.py's examples 1-4: LeNet alone, two inputs, a list input, a dict input."""
    expected = {"total_params": 61610, "trainable_params": 61610}
    assert LENET_PARAMS == 61610
    assert Model(LeNet()).summary((1, 1, 28, 28)) == expected
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[2:] for line in out.splitlines() if line.strip()}
    assert rows["features.0"] == ["[1,", "1,", "28,", "28]", "[1,", "6,", "28,", "28]", "60"]
    assert rows["features.3"][-5:] == ["[1,", "16,", "10,", "10]", "2,416"]
    assert [rows[f"fc.{i}"][-1] for i in range(3)] == ["48,120", "10,164", "850"]
    assert "Total params: 61,610" in out and "Non-trainable params: 0" in out
    multi = Model(LeNetMultiInput()).summary(
        [(1, 1, 28, 28), (1, 400)], dtype=["float32", "float32"]
    )
    assert multi == expected
    lists = Model(LeNetListInput()).summary(input=[torch.rand(1, 1, 28, 28), torch.rand(1, 400)])
    assert lists["total_params"] == 61610
    dicts = {"x1": torch.rand(1, 1, 28, 28), "x2": torch.rand(1, 400)}
    assert Model(LeNetDictInput()).summary(input=dicts) == expected


class MobileBlock(nn.Module):
    """A small MobileNetV2 (stem, one inverted residual, pooling, dropout, classifier).

    Paddle's test runs paddle.vision's mobilenet_v2 (no torchvision here); this has each of
    its layer kinds, with FLOPs small enough to count by hand.
    """

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6()
        )
        self.block = nn.Sequential(
            nn.Conv2d(8, 16, 1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU6(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU6(),
            nn.Conv2d(16, 8, 1, bias=False),
            nn.BatchNorm2d(8),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(8, 10))

    def forward(self, x):
        x = self.stem(x)
        x = x + self.block(x)
        return self.classifier(torch.flatten(self.pool(x), 1))


def test_dynamic_flops(capsys):
    """TestModelFunction.test_dynamic_flops: a MobileNetV2, Dropout counted by a custom op."""

    def customize_dropout(m, x, y):
        m.total_ops += 0

    net = MobileBlock()
    total = hapi.flops(
        net, [1, 3, 8, 8], custom_ops={nn.Dropout: customize_dropout}, print_detail=True
    )
    small, wide = 8 * 4 * 4, 16 * 4 * 4  # output elements at 8 and 16 channels, 4x4
    expected = (
        small * (3 * 3 * 3)  # stem conv, no bias
        + 2 * small  # BatchNorm
        + wide * 8  # 1x1 expand
        + 2 * wide
        + wide * (16 // 16 * 3 * 3)  # depthwise 3x3
        + 2 * wide
        + small * 16  # 1x1 project
        + 2 * small
        + (4 * 4 + 1) * 8  # adaptive average pooling to 1x1: a window's adds and a division
        + 0  # dropout (the custom op)
        + 8 * 10  # linear (Paddle counts no bias add)
    )
    assert total == expected == 11608
    out = capsys.readouterr().out
    assert f"Total Flops: {expected}" in out and "Layer Name" in out


def test_dynamic_flops_with_multiple_outputs(capsys):
    """TestModelFunction.test_dynamic_flops_with_multiple_outputs: a layer returning two tensors."""

    def customize_dropout(m, x, y):
        m.total_ops += 0

    net = nn.MaxPool2d(kernel_size=2, stride=2, padding=0, return_indices=True)
    total = hapi.flops(
        net, [1, 2, 32, 32], custom_ops={nn.Dropout: customize_dropout}, print_detail=True
    )
    assert total == 0  # Paddle has no count function for max pooling
    assert "[1, 2, 16, 16]" in capsys.readouterr().out  # the first output's shape


def test_flops_docstring_example(capsys):
    """dynamic_flops.py's example: LeNet on [1, 1, 28, 28] is 347,560 FLOPs, as printed."""

    def count_leaky_relu(m, x, y):
        m.total_ops += int(x[0].numel())

    total = hapi.flops(
        LeNet(), [1, 1, 28, 28], custom_ops={nn.LeakyReLU: count_leaky_relu}, print_detail=True
    )
    per_layer = {
        "features.0": 6 * 28 * 28 * (1 * 3 * 3 + 1),  # 47,040
        "features.3": 16 * 10 * 10 * (6 * 5 * 5 + 1),  # 241,600
        "fc.0": 400 * 120,
        "fc.1": 120 * 84,
        "fc.2": 84 * 10,
    }
    assert total == sum(per_layer.values()) == 347560
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line}
    for name, count in per_layer.items():
        assert rows[name][-1] == str(count)
    assert rows["features.2"][-2:] == ["0", "0"]  # max pooling: no parameters, no FLOPs
    assert rows["Total"] == ["Total", "Flops:", "347560", "Total", "Params:", "61610"]
