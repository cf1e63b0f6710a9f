"""model.export: a torch.export program that round-trips, takes any batch size, loads without torch-hapi."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import TinyNet
from torch import nn

from hapi import Model


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.head(x.flatten(1))


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.b(y)


class NormAndDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -self.fc(x)


class FixedBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).reshape(4, 3)


def exported(tmp_path, network: nn.Module, example, **kwargs):
    """Export through the public Model API and load the file back."""
    file = Model(network, device="cpu").export(tmp_path / "net", example, **kwargs)
    return file, torch.export.load(file).module()


@pytest.mark.parametrize(
    "make, shape", [(TinyNet, (4, 4)), (SmallCNN, (4, 1, 8, 8))], ids=["mlp", "cnn"]
)
def test_round_trip_gives_the_same_outputs_on_other_batch_sizes(tmp_path, make, shape):
    torch.manual_seed(0)
    network = make().eval()
    file, program = exported(tmp_path, network, torch.randn(shape))
    assert file == str(tmp_path / "net.pt2") and os.path.isfile(file)
    for batch in (4, 1, 7):
        x = torch.randn(batch, *shape[1:])
        torch.testing.assert_close(program(x), network(x), atol=1e-6, rtol=0)


def test_a_batch_of_one_example_still_gives_a_dynamic_batch(tmp_path):
    torch.manual_seed(0)
    network = SmallCNN().eval()
    _, program = exported(tmp_path, network, torch.randn(1, 1, 8, 8))
    for batch in (1, 5):
        x = torch.randn(batch, 1, 8, 8)
        torch.testing.assert_close(program(x), network(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("container", [tuple, list])
def test_several_inputs_and_numpy_arrays(tmp_path, container):
    torch.manual_seed(0)
    network = TwoInputs().eval()
    example = container(
        [
            np.random.default_rng(0).standard_normal((3, 4), dtype=np.float32),
            np.random.default_rng(1).standard_normal((3, 2), dtype=np.float32),
        ]
    )
    _, program = exported(tmp_path, network, example)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    torch.testing.assert_close(program(x, y), network(x, y), atol=1e-6, rtol=0)


def test_dynamic_batch_false_fixes_the_batch_size(tmp_path):
    torch.manual_seed(0)
    network = TinyNet().eval()
    _, program = exported(tmp_path, network, torch.randn(4, 4), dynamic_batch=False)
    x = torch.randn(4, 4)
    torch.testing.assert_close(program(x), network(x), atol=1e-6, rtol=0)
    with pytest.raises(Exception):
        program(torch.randn(5, 4))


class VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, *inputs):
        return sum(self.linear(x) for x in inputs)


@pytest.mark.parametrize("count", [1, 2])
def test_a_forward_taking_star_args_exports_with_a_fixed_batch(tmp_path, count):
    network = VarArgs().eval()
    example = tuple(torch.randn(3, 4) for _ in range(count))
    _, program = exported(
        tmp_path, network, example if count > 1 else example[0], dynamic_batch=False
    )
    torch.testing.assert_close(program(*example), network(*example), atol=1e-6, rtol=0)


def test_the_file_name_gets_pt2_and_parent_directories_are_created(tmp_path):
    model = Model(TinyNet(), device="cpu")
    assert model.export(tmp_path / "a" / "b" / "net", torch.randn(2, 4)) == str(
        tmp_path / "a/b/net.pt2"
    )
    assert model.export(str(tmp_path / "kept.pt2"), torch.randn(2, 4)) == str(tmp_path / "kept.pt2")
    assert sorted(os.listdir(tmp_path)) == ["a", "kept.pt2"]
    assert os.listdir(tmp_path / "a" / "b") == ["net.pt2"]


def test_exported_in_eval_mode_and_the_training_flags_are_restored(tmp_path):
    torch.manual_seed(0)
    network = NormAndDropout()
    for _ in range(3):  # running statistics that differ from a fresh BatchNorm's
        network(torch.randn(16, 4) * 3 + 1)
    network.head.eval()  # a mixed state must come back as it was
    model = Model(network, device="cpu")
    program = torch.export.load(model.export(tmp_path / "net", torch.randn(4, 4))).module()
    assert (
        model.network.training and model.network.body.training and not model.network.head.training
    )
    x = torch.randn(6, 4)
    network.eval()
    expected = network(x)
    torch.testing.assert_close(program(x), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(program(x), expected, atol=1e-6, rtol=0)  # no dropout: deterministic


def test_a_data_dependent_branch_is_explained(tmp_path):
    network = ValueBranch()
    with pytest.raises(RuntimeError) as caught:
        Model(network, device="cpu").export(tmp_path / "net", torch.randn(4, 4))
    message = str(caught.value)
    assert "ValueBranch" in message
    assert (
        "if x.sum() > 0" in message and f"{os.path.basename(__file__)}:" in message
    )  # the user's line
    assert "torch.cond" in message  # what to do
    assert caught.value.__cause__ is not None  # torch's own exception is chained
    assert network.training  # restored on failure too
    assert not os.path.exists(tmp_path / "net.pt2")


def test_a_batch_size_fixed_by_forward_points_to_dynamic_batch_false(tmp_path):
    with pytest.raises(RuntimeError, match=r"FixedBatch.*dynamic_batch=False"):
        exported(tmp_path, FixedBatch(), torch.randn(4, 4))
    network = FixedBatch().eval()
    _, program = exported(tmp_path, network, torch.randn(4, 4), dynamic_batch=False)
    x = torch.randn(4, 4)
    torch.testing.assert_close(program(x), network(x), atol=1e-6, rtol=0)


def test_a_failed_export_leaves_the_previous_file_byte_identical(tmp_path):
    Model(TinyNet(), device="cpu").export(tmp_path / "net", torch.randn(4, 4))
    before = (tmp_path / "net.pt2").read_bytes()
    with pytest.raises(RuntimeError):
        Model(ValueBranch(), device="cpu").export(tmp_path / "net", torch.randn(4, 4))
    assert (tmp_path / "net.pt2").read_bytes() == before
    assert os.listdir(tmp_path) == ["net.pt2"]  # no temporary file left behind


@pytest.mark.parametrize(
    "example, match",
    [
        ({"x": torch.randn(2, 4)}, r"example_inputs is dict.*tuple/list"),
        ([torch.randn(2, 4), "text"], r"example_inputs\[1\] is str"),
        ((), r"empty tuple"),
    ],
)
def test_example_inputs_that_are_not_tensors_are_refused(tmp_path, example, match):
    with pytest.raises(TypeError, match=match):
        Model(TinyNet(), device="cpu").export(tmp_path / "net", example)


def test_an_example_the_network_cannot_run_is_reported_before_export(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"TinyNet fails on example_inputs \(float32\[2, 5\]\).*mat1"
    ):
        Model(TinyNet(), device="cpu").export(tmp_path / "net", torch.randn(2, 5))


def test_the_file_loads_and_runs_without_torch_hapi(tmp_path):
    torch.manual_seed(0)
    network = SmallCNN().eval()
    file = Model(network, device="cpu").export(tmp_path / "net", torch.randn(2, 1, 8, 8))
    x = torch.randn(3, 1, 8, 8)
    torch.save(x, tmp_path / "x.pt")
    script = textwrap.dedent("""
        import sys

        class NoProjectCode:
            # Fails any import of the project's code (the editable install would find it otherwise).
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("hapi", "callbacks", "conftest", "test_export"):
                    raise ImportError(name + " is not available here")
                return None

        sys.meta_path.insert(0, NoProjectCode())
        import torch

        program = torch.export.load(sys.argv[1]).module()
        torch.save(program(torch.load(sys.argv[2])), sys.argv[3])
        print(sorted({m.split(".")[0] for m in sys.modules} & {"hapi", "callbacks"}))
    """)
    command = [
        sys.executable,
        "-I",
        "-c",
        script,
        file,
        str(tmp_path / "x.pt"),
        str(tmp_path / "y.pt"),
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), network(x), atol=1e-6, rtol=0)


def test_a_forward_whose_collective_fails_is_not_blamed_on_the_example_inputs(tmp_path):
    """A forward that needs the other processes gets that explanation, not advice on inputs."""

    class Gathering(torch.nn.Linear):
        def forward(self, x):
            raise torch.distributed.DistBackendError("connection reset by peer")

    model = Model(Gathering(4, 2), device="cpu")
    with pytest.raises(RuntimeError, match=r"made a collective that failed.*other processes"):
        model.export(tmp_path / "net", torch.randn(2, 4))
