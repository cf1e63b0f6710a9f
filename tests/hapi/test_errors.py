"""Bad input gets an error of the right type that names the problem and says what to do."""

from __future__ import annotations

import os
import re
import shlex

import numpy as np
import pytest
import torch
import torchmetrics
from conftest import TinyNet, make_tiny_data
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from hapi import Model
from hapi.checkpoint import CheckpointError
from hapi.metrics import Accuracy


def model_with(**prepare) -> Model:
    torch.manual_seed(0)
    model = Model(TinyNet(), device="cpu")
    if prepare.pop("adam", False):
        prepare["optimizer"] = torch.optim.Adam(model.parameters(), lr=0.01)
    model.prepare(**prepare)
    return model


def ready_model() -> Model:
    return model_with(adam=True, loss=nn.CrossEntropyLoss(), metrics=Accuracy())


# -- calling things in the wrong order -----------------------------------------------------


def test_fit_before_prepare(tiny_net, tiny_data):
    with pytest.raises(
        RuntimeError, match=r"fit\(\) needs a prepared model: call model\.prepare\("
    ):
        Model(tiny_net, device="cpu").fit(tiny_data, verbose=0)


def test_evaluate_before_prepare(tiny_net, tiny_data):
    with pytest.raises(
        RuntimeError, match=r"evaluate\(\) needs a prepared model: call model\.prepare\("
    ):
        Model(tiny_net, device="cpu").evaluate(tiny_data, verbose=0)


def test_prepare_from_a_callback_of_a_running_fit_says_to_change_settings_in_place(tiny_data):
    from callbacks import LambdaCallback

    model = ready_model()

    def prepare_again(epoch, logs):
        model.prepare(torch.optim.SGD(model.parameters(), lr=0.01), nn.CrossEntropyLoss())

    with pytest.raises(
        RuntimeError,
        match=r"prepare\(\) was called while fit\(\) runs .*model\.optimizer\.param_groups",
    ):
        model.fit(
            tiny_data, epochs=2, verbose=0, callbacks=LambdaCallback(on_epoch_end=prepare_again)
        )
    assert model.fit(tiny_data, verbose=0).history["loss"]  # the model trains on afterwards


def test_fit_without_loss(tiny_data):
    model = model_with(adam=True)
    with pytest.raises(
        RuntimeError,
        match=r"prepare\(\) got no loss.*TinyNet returned no 'loss'.*"
        r"prepare\(loss=\.\.\.\)",
    ):
        model.fit(tiny_data, verbose=0)


def test_fit_without_optimizer(tiny_data):
    model = model_with(loss=nn.CrossEntropyLoss())
    with pytest.raises(
        RuntimeError, match=r"fit\(\) needs an optimizer: call model\.prepare\(optimizer="
    ):
        model.fit(tiny_data, verbose=0)


def test_evaluate_without_loss_or_metrics_returns_nothing_but_fit_raises(tiny_data):
    # Paddle's evaluate returns {} with neither loss nor metrics (it was an error here);
    # training without a loss has nothing to train and still says so.
    model = model_with(adam=True)
    assert model.evaluate(tiny_data, verbose=0) == {}
    with pytest.raises(RuntimeError, match=r"prepare\(\) got no loss.*prepare\(loss=\.\.\.\)"):
        model.fit(tiny_data, verbose=0)


# -- prepare() arguments -----------------------------------------------------------------------


def accuracy(outputs, labels):
    return (outputs.argmax(-1) == labels).float().mean()


@pytest.mark.parametrize(
    "metrics, error, pattern",
    [
        (
            accuracy,
            TypeError,
            r"must be a torchmetrics\.Metric; received <function accuracy.*torchmetrics\.Metric subclass",
        ),
        (
            [torchmetrics.classification.MulticlassAccuracy],
            TypeError,
            r"metrics\[0\] is the class MulticlassAccuracy, not an instance; write MulticlassAccuracy\(\.\.\.\)",
        ),
        (
            {"x": "acc"},
            TypeError,
            r"metrics\['x'\] must be a torchmetrics\.Metric; received 'acc' of type str",
        ),
    ],
    ids=["function", "metric-class", "string-in-dict"],
)
def test_prepare_rejects_bad_metrics(tiny_net, metrics, error, pattern):
    model = Model(tiny_net, device="cpu")
    with pytest.raises(error, match=pattern):
        model.prepare(loss=nn.CrossEntropyLoss(), metrics=metrics)


def test_prepare_rejects_loss_class(tiny_net):
    with pytest.raises(
        TypeError,
        match=r"loss is the class CrossEntropyLoss; pass an instance, e\.g\. CrossEntropyLoss\(\)",
    ):
        Model(tiny_net, device="cpu").prepare(loss=nn.CrossEntropyLoss)


def test_prepare_rejects_optimizer_name(tiny_net):
    with pytest.raises(
        TypeError,
        match=r"optimizer must be a torch\.optim\.Optimizer, or a list or dict of "
        r"them .*; received 'adam'\. Example: torch\.optim\.Adam\(model\.parameters\(\)",
    ):
        Model(tiny_net, device="cpu").prepare(optimizer="adam", loss=nn.CrossEntropyLoss())


def test_prepare_refuses_an_optimizer_over_another_module(tiny_net, tiny_data):
    model = Model(tiny_net, device="cpu")
    other = TinyNet()
    with pytest.raises(
        ValueError,
        match=r"the optimizer \(SGD\) holds 4 parameters, none of them among the 4 of the "
        r"network \(TinyNet\) or the loss, so fit would train nothing\. Build it over the "
        r"model's: SGD\(model\.parameters\(\), \.\.\.\)",
    ):
        model.prepare(torch.optim.SGD(other.parameters(), lr=0.1), nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match=r"optimizer 'd' \(Adam\) holds 2 parameters, none"):
        model.prepare(
            {
                "g": torch.optim.SGD(model.parameters()),
                "d": torch.optim.Adam(nn.Linear(2, 2).parameters()),
            }
        )


class ScaledLoss(nn.Module):
    """A loss with a parameter of its own, which fit trains too."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, outputs, labels):
        return self.scale * nn.functional.cross_entropy(outputs, labels)


def test_an_optimizer_over_part_of_the_network_fine_tunes_that_part(tiny_net, tiny_data):
    model = Model(tiny_net, device="cpu")
    before = {k: v.clone() for k, v in model.network.state_dict().items()}
    model.prepare(torch.optim.SGD(tiny_net.out.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model.fit(tiny_data, batch_size=16, epochs=1, verbose=0)
    after = model.network.state_dict()
    assert torch.equal(after["hidden.weight"], before["hidden.weight"])  # not given: kept
    assert not torch.equal(after["out.weight"], before["out.weight"])
    loss = ScaledLoss()  # an optimizer over the loss's own parameters is no mistake either
    model.prepare(torch.optim.SGD(loss.parameters(), lr=0.1), loss)
    model.fit(tiny_data, batch_size=16, epochs=1, verbose=0)
    assert loss.scale.item() != 1.0

    class OwnStep(Model):  # a step of one's own may train parameters the Model holds itself
        def train_step(self, batch):
            inputs, labels = batch
            loss = nn.functional.cross_entropy(self.network(inputs) * self.temperature, labels)
            self.optimizers["network"].zero_grad()
            self.optimizers["temperature"].zero_grad()
            loss.backward()
            self.optimizers["network"].step()
            self.optimizers["temperature"].step()
            return {"loss": loss.detach()}

    own = OwnStep(tiny_net, device="cpu")
    own.temperature = nn.Parameter(torch.ones(()))
    own.prepare(
        {
            "network": torch.optim.SGD(tiny_net.parameters(), lr=0.1),
            "temperature": torch.optim.SGD([own.temperature], lr=0.1),
        }
    )
    own.fit(tiny_data, batch_size=16, epochs=1, verbose=0)
    assert own.temperature.item() != 1.0


@pytest.mark.parametrize(
    "name, instead",
    [("compile", r"prepare\(optimizer, loss, metrics\)"), ("train_on_batch", r"train_batch\(")],
)
def test_a_keras_name_says_what_to_call_instead(tiny_net, name, instead):
    model = Model(tiny_net, device="cpu")
    with pytest.raises(
        AttributeError,
        match=rf"Model has no {name}\(\), Keras's name: torch-hapi calls it model\.{instead}",
    ):
        getattr(model, name)(optimizer="adam", loss="mse")
    assert not hasattr(model, name)
    with pytest.raises(AttributeError, match=r"^'Model' object has no attribute 'netwrk'$"):
        model.netwrk  # noqa: B018 -- any other name: Python's own message


def test_prepare_rejects_unknown_amp(tiny_net):
    with pytest.raises(ValueError, match=r"amp must be None, 'bf16' or 'fp16'; received 'fp8'"):
        Model(tiny_net, device="cpu").prepare(loss=nn.CrossEntropyLoss(), amp="fp8")


# -- checkpoint files ----------------------------------------------------------------------------


def test_load_missing_checkpoint_names_the_paths_tried(tmp_path):
    model = ready_model()
    model.save(tmp_path / "other")
    with pytest.raises(
        FileNotFoundError, match=re.escape(repr(str(tmp_path / "final.pt")))
    ) as caught:
        model.load(tmp_path / "final")
    assert "other.pt" in str(caught.value)  # lists what is there instead
    assert "Model.save()" in str(caught.value)


def test_load_truncated_checkpoint(tmp_path):
    model = ready_model()
    file = model.save(tmp_path / "ckpt")
    data = open(file, "rb").read()
    with open(file, "wb") as handle:
        handle.write(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError, match=re.escape(repr(file)) + r".*truncated or corrupt.*earlier checkpoint"
    ):
        model.load(tmp_path / "ckpt")


@pytest.mark.parametrize("seed", range(5))
def test_load_corrupt_checkpoint(tmp_path, seed):
    file = tmp_path / "ckpt.pt"
    file.write_bytes(
        np.random.default_rng(seed).integers(0, 256, size=4096, dtype=np.uint8).tobytes()
    )
    with pytest.raises(
        CheckpointError, match=re.escape(repr(str(file))) + r".*truncated or corrupt"
    ) as caught:
        ready_model().load(file)
    # Damaged bytes are not reported as a file that carries code (nor met with advice to
    # load it with weights_only=False).
    assert "carry code" not in str(caught.value) and "weights_only=False" not in str(caught.value)


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_load_checkpoint_cut_anywhere(tmp_path, zip_format):
    """Wherever a file is cut, the error is a CheckpointError naming it, never an IndexError from torch's reader."""
    torch.save(
        TinyNet().state_dict(), tmp_path / "whole.pt", _use_new_zipfile_serialization=zip_format
    )
    data = (tmp_path / "whole.pt").read_bytes()
    model = ready_model()
    file = tmp_path / "cut.pt"
    for cut in range(0, len(data), max(1, len(data) // 150)):
        file.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=re.escape(repr(str(file)))):
            model.load(file)


class RunsCode:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def test_load_refuses_a_checkpoint_that_carries_code(tmp_path):
    state = {"format": "torch-hapi", "version": 1, "network": TinyNet().state_dict()}
    # The payload is live: an unsafe load of the same file runs it.
    torch.save({**state, "payload": RunsCode(tmp_path / "proof")}, tmp_path / "proof.pt")
    torch.load(tmp_path / "proof.pt", weights_only=False)
    assert (tmp_path / "proof").exists()

    torch.save({**state, "payload": RunsCode(tmp_path / "marker")}, tmp_path / "evil.pt")
    with pytest.raises(
        CheckpointError,
        match=re.escape(repr(str(tmp_path / "evil.pt")))
        + r".*refuses to load it.*weights_only=True.*never execute code",
    ) as caught:
        ready_model().load(tmp_path / "evil.pt")
    assert "system" in str(caught.value)  # names what the file wanted to call
    assert not (tmp_path / "marker").exists()


def test_load_a_file_that_is_not_a_checkpoint(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(
        CheckpointError, match=r"not a torch-hapi checkpoint nor a state_dict.*Model\.save\(path\)"
    ):
        ready_model().load(tmp_path / "list.pt")


class WiderNet(TinyNet):
    def __init__(self) -> None:
        super().__init__(in_features=5)
        self.extra = nn.Linear(3, 3)


def test_load_checkpoint_of_another_architecture(tmp_path):
    Model(WiderNet(), device="cpu").save(tmp_path / "wider")
    model = ready_model()
    before = {k: v.clone() for k, v in model.network.state_dict().items()}
    with pytest.raises(CheckpointError) as caught:
        model.load(tmp_path / "wider")
    message = str(caught.value)
    assert "hidden.weight: file (16, 5) vs network (16, 4)" in message
    assert "extra.weight" in message and "extra.bias" in message
    assert "skip_mismatch=True" in message
    assert str(tmp_path / "wider.pt") in message
    assert all(torch.equal(before[k], v) for k, v in model.network.state_dict().items()), (
        "a refused load changed the weights"
    )


def test_load_optimizer_state_of_another_optimizer(tmp_path):
    x, y = make_tiny_data()
    source = ready_model()
    source.train_batch(x, y)
    source.save(tmp_path / "adam")
    target = model_with(loss=nn.CrossEntropyLoss())
    target.prepare(
        optimizer=torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9),
        loss=nn.CrossEntropyLoss(),
    )
    with pytest.raises(
        CheckpointError, match=r"optimizer state in .*adam\.pt.*SGD.*reset_optimizer=True"
    ):
        target.load(tmp_path / "adam")
    target.load(tmp_path / "adam", reset_optimizer=True)
    target.train_batch(x, y)  # the SGD optimizer still works


# -- data and fit() arguments ---------------------------------------------------------------------


class EmptyDataset(Dataset):
    def __len__(self):
        return 0

    def __getitem__(self, index):
        raise IndexError(index)


@pytest.mark.parametrize(
    "data, error, pattern",
    [
        (
            "train.csv",
            TypeError,
            r"train_data must be a torch\.utils\.data\.Dataset.*; received str",
        ),
        (
            (np.zeros((96, 4), np.float32), np.zeros(95, np.int64)),
            ValueError,
            r"train_data have different lengths \[96, 95\]; every array of the tuple must have one row per sample",
        ),
        (
            (torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)),
            ValueError,
            r"train_data is empty \(0 samples\)",
        ),
        (EmptyDataset(), ValueError, r"train_data is empty \(0 samples\)"),
    ],
    ids=["string", "different-lengths", "empty-tuple", "empty-dataset"],
)
def test_fit_rejects_bad_data(data, error, pattern):
    with pytest.raises(error, match=pattern):
        ready_model().fit(data, verbose=0)


class _SizedStream(IterableDataset):
    def __iter__(self):
        return iter(TensorDataset(*make_tiny_data(4)))

    def __len__(self):
        return 4


@pytest.mark.parametrize(
    "data",
    [
        TensorDataset(*make_tiny_data(4)),
        DataLoader(_SizedStream(), batch_size=6, drop_last=True),
    ],
    ids=["dataset", "users-loader-over-a-sized-stream"],
)
def test_a_batch_larger_than_the_data_with_drop_last_says_what_to_change(data):
    with pytest.raises(
        ValueError,
        match=r"train_data is empty \(no batch at batch_size=6, drop_last=True\), so there is "
        r"nothing to iterate over\. Lower batch_size or set drop_last=False\.",
    ):
        ready_model().fit(data, batch_size=6, drop_last=True, verbose=0)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (
            {"batch_size": 0},
            r"fit: batch_size must be a positive int; received 0 \(int\)\. Pass e\.g\. batch_size=1",
        ),
        (
            {"epochs": 0},
            r"fit: epochs must be a positive int; received 0 \(int\)\. Pass e\.g\. epochs=1",
        ),
        (
            {"verbose": 4},
            r"verbose must be 0 \(silent\), 1 \(progress bar\), 2 .* or 3 .*; received 4",
        ),
    ],
)
def test_fit_rejects_bad_arguments(tiny_data, kwargs, pattern):
    model = ready_model()
    before = {k: v.clone() for k, v in model.network.state_dict().items()}
    with pytest.raises(ValueError, match=pattern):
        model.fit(tiny_data, **{"verbose": 0, **kwargs})
    assert all(torch.equal(before[k], v) for k, v in model.network.state_dict().items())


@pytest.mark.parametrize(
    "labels, described",
    [
        (lambda y: y.float(), "float32[96]"),
        (lambda y: y[:, None], "int64[96, 1]"),
    ],
    ids=["float-labels", "column-labels"],
)
@pytest.mark.parametrize("method", ["fit", "evaluate"])
def test_loss_failure_names_outputs_and_labels(labels, described, method):
    x, y = make_tiny_data()
    model = ready_model()
    with pytest.raises(
        RuntimeError,
        match=re.escape(f"outputs (float32[96, 3]) and labels ({described})")
        + r".*CrossEntropyLoss wants scores \[N, C\] and int64 class indices \[N\]",
    ):
        getattr(model, method)((x, labels(y)), batch_size=96, verbose=0)
