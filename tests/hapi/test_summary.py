"""Model.summary: Paddle's readings of input_size, input= and dtype; a forward changing nothing."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from hapi import Model


def rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}


def test_an_int_is_a_one_dimensional_shape_without_a_batch_dimension(capsys):
    Model(nn.Linear(20, 10)).summary(20)
    assert rows(capsys.readouterr().out)["Linear"][1:4] == ["[20]", "[10]", "210"]


def test_a_list_of_shapes_gives_one_input_each_with_its_own_dtype(capsys):
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.fc = nn.Linear(4, 2)

        def forward(self, tokens, weights):
            return self.fc(self.embed(tokens) * weights)

    Model(TwoInputs()).summary([(None, 3), (-1, 3, 1)], dtype=["int64", torch.float32])
    table = rows(capsys.readouterr().out)
    assert table["embed"][1:3] == ["[1,", "3]"]  # batch dimension read as 1
    assert table["fc"][-2:] == ["2]", "10"]


def test_nested_tuples_reach_the_network_as_tuples(capsys):
    seen = []

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(16, 32, 2, batch_first=True)

        def forward(self, x, state):
            seen.append(type(state))
            return self.lstm(x, state)

    Model(Recurrent()).summary([(-1, 23, 16), ((2, None, 32), (2, -1, 32))])
    assert seen == [tuple]
    assert "[1, 23, 32], [2, 1, 32], [2, 1, 32]" in capsys.readouterr().out


def test_two_unknown_dimensions_name_the_size_and_the_rule():
    with pytest.raises(ValueError, match=r"input_size \(-1, -1\) has 2 dimensions") as raised:
        Model(nn.Linear(2, 2)).summary((-1, -1))
    assert "only the first (batch) dimension may be -1 or None" in str(raised.value)
    with pytest.raises(ValueError, match=r"holds the shape \(2, None, -1\)"):
        Model(nn.Linear(2, 2)).summary([(1, 2), (2, None, -1)])


def test_sizes_below_one_and_non_sizes_are_refused():
    with pytest.raises(ValueError, match=r"has the size 0"):
        Model(nn.Linear(2, 2)).summary((4, 0))
    with pytest.raises(TypeError, match=r"holds 2.0 \(float\)"):
        Model(nn.Linear(2, 2)).summary((4, 2.0))


def test_dtype_names_and_counts_are_checked():
    with pytest.raises(TypeError, match=r"received 'float33'"):
        Model(nn.Linear(2, 2)).summary((1, 2), dtype="float33")
    with pytest.raises(ValueError, match=r"2 entries for 1 inputs"):
        Model(nn.Linear(2, 2)).summary([(1, 2)], dtype=["float32", "int64"])


def test_input_is_passed_as_the_one_argument_and_excludes_input_size(capsys):
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, batch):
            return self.fc(batch["x"] + batch["y"])

    pair = {"x": torch.ones(5, 3), "y": torch.ones(5, 3)}
    assert Model(Pair()).summary(input=pair)["total_params"] == 4
    assert rows(capsys.readouterr().out)["fc"][1:3] == ["[5,", "3]"]
    with pytest.raises(ValueError, match="either input_size"):
        Model(Pair()).summary((5, 3), input=pair)


def test_each_module_keeps_its_own_mode_and_batchnorm_its_statistics():
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    net.train()
    net[1].eval()  # frozen statistics inside a training network
    before = net[1].running_mean.clone()
    Model(net).summary((8, 4))
    assert [m.training for m in net.modules()] == [True, True, False, True]
    assert torch.equal(net[1].running_mean, before)
    assert all(p.grad is None for p in net.parameters())


def test_a_failing_forward_says_which_example_inputs_it_had():
    with pytest.raises(RuntimeError) as raised:
        Model(nn.Linear(20, 10)).summary((1, 5))
    if sys.version_info < (3, 11):
        pytest.skip("exception notes need Python 3.11")
    assert "input_size=(1, 5)" in "".join(getattr(raised.value, "__notes__", []))


def test_one_input_takes_a_one_element_list_of_dtypes_as_paddle_does():
    network = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 2))
    expected = {"total_params": 818, "trainable_params": 818}
    assert Model(network).summary((1, 28), dtype=["int64"]) == expected
    assert Model(network).summary(28, dtype=("int64",)) == expected
    with pytest.raises(ValueError, match=r"dtype \['int64', 'int64'\] is a list"):
        Model(network).summary((1, 28), dtype=["int64", "int64"])
