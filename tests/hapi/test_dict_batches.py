"""Dict samples (the Hugging Face convention): keys go to the network by name, labels to loss and metrics."""

from __future__ import annotations

import pytest
import torch
from dict_models import CLASSES, TinyClassifier, TokenData, hand_loop
from torch import nn

from hapi import Model
from hapi.metrics import Accuracy


def _max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _model(**model_args) -> Model:
    torch.manual_seed(0)
    return Model(TinyClassifier(), **model_args)


def test_without_a_loss_the_networks_own_loss_is_trained_and_logged():
    data = TokenData()
    model = _model()
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), metrics=Accuracy())
    history = model.fit(data, eval_data=data, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert _max_difference(model.network, hand_loop(data, batch=8, epochs=2, lr=0.5)) < 1e-6
    assert {"loss", "acc", "val_loss", "val_acc"} <= set(history.history)
    with torch.no_grad():
        output = model.network(data.ids, data.mask, labels=data.labels)
    figures = model.evaluate(data, batch_size=5, verbose=0)
    assert figures["loss"] == pytest.approx(output["loss"].item(), rel=1e-5)
    accuracy = (output["logits"].argmax(-1) == data.labels).float().mean().item()
    assert figures["acc"] == pytest.approx(accuracy)
    assert history.history["val_acc"][-1] == pytest.approx(accuracy)


def test_with_a_loss_the_label_keys_go_to_it_and_not_to_the_network():
    data = TokenData(label_key="target")
    seen = []

    class Recording(TinyClassifier):
        def forward(self, input_ids, attention_mask, labels=None):
            seen.append(labels)
            return super().forward(input_ids, attention_mask)

    torch.manual_seed(0)
    model = Model(Recording(), labels=["target"])
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss(), Accuracy())
    model.fit(data, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert seen and all(labels is None for labels in seen)
    assert _max_difference(model.network, hand_loop(data, batch=8, epochs=2, lr=0.5)) < 1e-6


def test_predict_returns_the_logits_in_data_order():
    data = TokenData(n=13)
    model = _model()
    model.prepare(metrics=Accuracy())
    (logits,) = model.predict(data, batch_size=4, stack_outputs=True, verbose=0)
    with torch.no_grad():
        expected = model.network(data.ids, data.mask)["logits"]
    assert logits.shape == (13, CLASSES)
    torch.testing.assert_close(logits, expected)


def test_missing_label_keys_and_a_network_without_loss_are_explained():
    model = _model(labels=["target"])
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    with pytest.raises(KeyError, match=r"without the label keys \['target'\].*Model\(labels="):
        model.fit(TokenData(), batch_size=8, verbose=0)

    class NoLoss(TinyClassifier):
        def forward(self, input_ids, attention_mask, labels=None):
            return super().forward(input_ids, attention_mask)["logits"]

    model = Model(NoLoss())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"prepare\(\) got no loss.*NoLoss returned no 'loss'"):
        model.fit(TokenData(), batch_size=8, verbose=0)


def test_an_output_object_with_loss_and_logits_attributes_works_like_a_dict():
    class Output:
        def __init__(self, loss, logits):
            self.loss, self.logits = loss, logits

    class AttributeOutput(TinyClassifier):
        def forward(self, input_ids, attention_mask, labels=None):
            result = super().forward(input_ids, attention_mask, labels)
            return Output(result.get("loss"), result["logits"])

    data = TokenData()
    torch.manual_seed(0)
    model = Model(AttributeOutput())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), metrics=Accuracy())
    model.fit(data, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert _max_difference(model.network, hand_loop(data, batch=8, epochs=2, lr=0.5)) < 1e-6
