"""Dict samples (the Hugging Face convention): keys go to the network by name, labels to loss and metrics."""

from __future__ import annotations

from collections import UserDict
from collections.abc import Mapping

import pytest
import torch
from dict_models import CLASSES, TinyClassifier, TokenData, hand_loop
from torch import nn
from torch.utils.data import DataLoader, default_collate

from hapi import Model
from hapi.batches import BatchSplitter
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


# -- batches that are a Mapping but not a dict (BatchEncoding, a collator's UserDict) ------------


class Features(Mapping):
    """A read-only Mapping that is no dict: what a tokenizer or collator may hand back."""

    def __init__(self, values) -> None:
        self._values = dict(values)

    def __getitem__(self, key):
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


class Encoding(UserDict):
    """Shaped like transformers' BatchEncoding: a UserDict subclass with a ``to`` of its own."""

    def to(self, device):
        return Encoding({key: value.to(device) for key, value in self.items()})


def user_dict_collate(samples):
    return UserDict(default_collate(samples))


def features_collate(samples):
    return Features(default_collate(samples))


def encoding_collate(samples):
    return Encoding(default_collate(samples))


@pytest.mark.parametrize(
    "collate", [user_dict_collate, features_collate, encoding_collate], ids=lambda c: c.__name__
)
def test_a_collate_fn_returning_a_mapping_is_split_by_key_like_a_dict(collate):
    """The old code passed the whole Mapping to the network as one argument: TypeError."""
    data = TokenData()
    model = _model()
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), metrics=Accuracy())
    loader = DataLoader(data, batch_size=8, collate_fn=collate)
    history = model.fit(loader, eval_data=loader, epochs=2, verbose=0)
    assert _max_difference(model.network, hand_loop(data, batch=8, epochs=2, lr=0.5)) < 1e-6
    with torch.no_grad():
        output = model.network(data.ids, data.mask, labels=data.labels)
    accuracy = (output["logits"].argmax(-1) == data.labels).float().mean().item()
    assert history.history["val_acc"][-1] == pytest.approx(accuracy)
    (logits,) = model.predict(loader, stack_outputs=True, verbose=0)
    torch.testing.assert_close(logits, output["logits"])


def test_mapping_label_keys_go_to_the_loss_and_the_rest_to_the_network_as_keywords():
    data = TokenData(label_key="target")
    seen = []

    class Recording(TinyClassifier):
        def forward(self, input_ids, attention_mask, labels=None):
            seen.append((input_ids.shape, labels))
            return super().forward(input_ids, attention_mask)["logits"]

    torch.manual_seed(0)
    model = Model(Recording(), labels=["target"])
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), nn.CrossEntropyLoss())
    model.fit(DataLoader(data, batch_size=8, collate_fn=user_dict_collate), epochs=2, verbose=0)
    assert len(seen) == 12 and all(labels is None for _, labels in seen)
    assert _max_difference(model.network, hand_loop(data, batch=8, epochs=2, lr=0.5)) < 1e-6


class UserDictSamples(TokenData):
    def __getitem__(self, index: int) -> UserDict:
        return UserDict(super().__getitem__(index))


def test_samples_that_are_user_dicts_are_batched_and_split_like_dicts():
    data = UserDictSamples()
    model = _model()
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), metrics=Accuracy())
    model.fit(data, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert _max_difference(model.network, hand_loop(data, batch=8, epochs=2, lr=0.5)) < 1e-6


@pytest.mark.parametrize("kind", [UserDict, Features, Encoding], ids=lambda k: k.__name__)
def test_a_mapping_batch_is_moved_to_the_device_key_by_key(kind):
    """Whole (its type kept) for every step, then split by key for the built-in one; an old
    version left a non-dict batch where it was (the "meta" device shows it on a CPU)."""
    splitter = BatchSplitter(torch.device("meta"), None, None)
    batch = kind({"input_ids": torch.ones(2, 3), "labels": torch.zeros(2)})
    moved = splitter.to_device(batch)
    assert type(moved) is kind and all(value.is_meta for value in moved.values())
    (inputs,), (labels,) = splitter.split(moved)
    assert set(inputs) == {"input_ids"} and inputs["input_ids"].is_meta and labels.is_meta
    assert BatchSplitter.length(batch) == 2
