"""The loop's behaviour against Keras 3's trainer tests and Paddle hapi's model tests.

Translations (keras.layers.Dense(units, use_bias=False, kernel_initializer="ones") ->
nn.Linear(in, units, bias=False) with ones; Paddle's InputSpec -> counts; static-graph
variants dropped). Each test's docstring names what it translates. Where torch-hapi differs
on purpose, the test asserts torch-hapi's behaviour and says why (docs/guides/migrating.md, "Where torch-hapi differs from Keras").
"""

from __future__ import annotations

import pytest
import torch
import torchmetrics
from torch import nn
from torch.utils.data import IterableDataset

from callbacks import Callback
from hapi import Model


def example_model(units: int = 3, features: int = 4) -> nn.Linear:
    """Keras' ExampleModel: a bias-free dense layer whose kernel is all ones."""
    layer = nn.Linear(features, units, bias=False)
    nn.init.ones_(layer.weight)
    return layer


class Stream(IterableDataset):
    """Keras' infinite_gen (long, not endless, so that a missed stop fails instead of hanging)."""

    def __init__(self, with_labels: bool, samples: int = 400) -> None:
        self.with_labels, self.samples = with_labels, samples

    def __iter__(self):
        for _ in range(self.samples):
            x = torch.ones(2)
            yield (x, torch.ones(3)) if self.with_labels else (x,)


@pytest.mark.parametrize(
    "method, gerund, hook",
    [
        ("fit", "training", "on_train_batch_end"),
        ("evaluate", "evaluating", "on_eval_batch_end"),
        ("predict", "predicting", "on_predict_batch_end"),
    ],
)
def test_stop_loop(method, gerund, hook):
    """Keras trainer_test.py::test_stop_loop: a callback setting ``stop_<gerund>`` after its
    5th batch end stops fit/evaluate/predict there, on data that would run much longer."""
    model = Model(example_model(3, 2))
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss(), metrics=None)

    def batch_end(self, *args, **kwargs):
        self.counter += 1
        if self.counter == 5:
            setattr(self.model, f"stop_{gerund}", True)

    # Keras' Stopper sets its hook on the instance; here the class overrides it.
    stopper = type("Stopper", (Callback,), {hook: batch_end})()
    stopper.counter = 0
    getattr(model, method)(
        Stream(with_labels=method != "predict"), batch_size=2, verbose=0, callbacks=[stopper]
    )
    assert stopper.counter == 5


def test_evaluate_flow():
    """Keras trainer_test.py::test_evaluate_flow: ones(100, 4) through a ones kernel against
    zeros gives a mean squared error of 16, for the loss and the metric alike. torch-hapi
    returns the dict (Keras' ``return_dict=True``), as Paddle does."""
    model = Model(example_model())
    model.prepare(loss=nn.MSELoss(), metrics=torchmetrics.MeanSquaredError())
    output = model.evaluate((torch.ones(100, 4), torch.zeros(100, 3)), batch_size=16, verbose=0)
    assert isinstance(output, dict) and set(output) == {"loss", "mean_squared_error"}
    assert output["loss"] == pytest.approx(16.0) and output["mean_squared_error"] == 16.0


def test_evaluate_with_custom_test_step():
    """Keras trainer_test.py::test_evaluate_with_custom_test_step: a step of one's own adds a
    figure to the ones evaluated (3 in all). torch-hapi's eval_step has no built-in step to
    call through super(), so it returns every figure itself."""

    class CustomStep(Model):
        def eval_step(self, batch):
            x, y = batch
            error = nn.functional.mse_loss(self.network(x), y)
            return {"loss": error, "mean_squared_error": error, "my_custom_metric": 5.0}

    model = CustomStep(example_model())
    model.prepare(loss=nn.MSELoss())
    output = model.evaluate((torch.ones(100, 4), torch.zeros(100, 3)), batch_size=16, verbose=0)
    assert len(output) == 3 and output["my_custom_metric"] == 5.0 and output["loss"] == 16.0


def test_fit_with_different_batch_size_same_loss():
    """Keras trainer_test.py::test_fit_with_different_batch_size_same_loss: a model with
    trainable=False trains (nothing changes) and its loss is the same at batch 80 and 100.
    torch's trainable=False is requires_grad=False on every parameter; fit warns once."""
    torch.manual_seed(0)
    x, y = torch.rand(100, 4), torch.ones(100, 1)
    model = Model(example_model(1).requires_grad_(False))
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.01), nn.MSELoss())
    with pytest.warns(UserWarning, match="nothing will be updated"):
        first = model.fit((x, y), batch_size=80, verbose=0).history["loss"]
    with pytest.warns(UserWarning, match="nothing will be updated"):
        second = model.fit((x, y), batch_size=100, verbose=0).history["loss"]
    assert first == pytest.approx(second, rel=1e-6)
    assert torch.equal(model.network.weight, torch.ones(1, 4))


def test_evaluate_without_loss_or_metrics():
    """Paddle test_model.py TestModel.predict: ``model.prepare()`` with neither loss nor
    metrics, then ``model.evaluate(test_loader)`` on images without labels runs (it raised
    here before) and has nothing to report. Training without a loss still raises (SPEC)."""
    torch.manual_seed(0)
    model = Model(nn.Sequential(nn.Flatten(), nn.Linear(4, 10)), inputs=1)
    model.prepare()
    images = torch.rand(8, 1, 2, 2)
    assert model.evaluate((images,), batch_size=4, verbose=0) == {}
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="prepare\\(\\) got no loss"):
        model.fit((images, torch.zeros(8, dtype=torch.long)), verbose=0)


def test_evaluate_with_metrics_only():
    """Paddle test_model.py TestModel.evaluate: ``prepare(metrics=Accuracy())`` without a loss
    evaluates the accuracy alone."""
    from hapi.metrics import Accuracy

    torch.manual_seed(0)
    network = nn.Linear(4, 3)
    x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
    model = Model(network)
    model.prepare(metrics=Accuracy())
    result = model.evaluate((x, y), batch_size=8, verbose=0)
    assert set(result) == {"acc"}
    assert result["acc"] == pytest.approx((network(x).argmax(-1) == y).float().mean().item())


def test_train_batch():
    """Paddle test_model.py TestModelFunction.test_train_batch: ``train_batch`` reports the
    loss of the batch before its update, as a hand step computes it (CrossEntropyLoss with
    reduction="sum", SGD 0.001). torch-hapi returns ``{"loss": ...}`` where Paddle returns a
    list: docs/guides/migrating.md (differences from Paddle) says why."""
    data, label = torch.rand(4, 20), torch.randint(0, 10, (4,))
    torch.manual_seed(1024)
    reference = nn.Linear(20, 10)
    expected = nn.functional.cross_entropy(reference(data), label, reduction="sum").item()
    torch.manual_seed(1024)
    network = nn.Linear(20, 10)
    model = Model(network)
    model.prepare(
        torch.optim.SGD(network.parameters(), lr=0.001), nn.CrossEntropyLoss(reduction="sum")
    )
    assert model.train_batch([data], [label])["loss"] == pytest.approx(expected, rel=1e-6)
    assert not torch.equal(network.weight, reference.weight)  # and it updated


def test_eval_batch_and_predict_batch():
    """Paddle test_model.py TestModelFunction.test_test_batch (``predict_batch`` equals the
    network's output in eval mode), and ``eval_batch``'s figures of that batch."""
    data, label = torch.rand(4, 20), torch.randint(0, 10, (4,))
    torch.manual_seed(1024)
    network = nn.Linear(20, 10)
    model = Model(network)
    model.prepare(loss=nn.CrossEntropyLoss())
    (output,) = model.predict_batch([data])
    torch.testing.assert_close(output, network(data).detach(), rtol=1e-6, atol=0)
    expected = nn.functional.cross_entropy(network(data), label).item()
    assert model.eval_batch([data], [label]) == {"loss": pytest.approx(expected, rel=1e-6)}


def test_a_network_that_returns_its_loss_evaluates_it():
    """Keras trainer_test.py::test_training_arg in spirit, with Paddle's hapi usage for
    nanoGPT (``Model(net, inputs=2, labels=0)``, ``loss=lambda out, loss: loss``): the loss
    fit trains is the loss evaluate reports (it reported 0.0)."""

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = example_model(1)

        def forward(self, x, y):
            out = self.dense(x)
            return out, nn.functional.mse_loss(out, y)

    x, y = torch.ones(8, 4), torch.zeros(8, 1)
    model = Model(WithLoss(), inputs=2, labels=0)
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.0), loss=lambda out, loss: loss)
    history = model.fit((x, y), (x, y), batch_size=4, verbose=0)
    assert history.history["loss"] == [16.0] and history.history["val_loss"] == [16.0]
    assert model.evaluate((x, y), verbose=0) == {"loss": 16.0}
