"""Data of any map-style kind (a datasets.Dataset look-alike, a list of samples) and fit's
(train, eval) batch sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TinyNet, make_tiny_data
from dict_models import TinyClassifier, TokenData, hand_loop
from torch import nn

from callbacks import Callback
from hapi import Model
from hapi.metrics import Accuracy


class Rows:
    """Behaves like a Hugging Face ``datasets.Dataset`` with the torch format, without being one.

    Not a torch ``Dataset``; ``rows[i]`` is a dict, ``rows[a:b]`` and ``rows[[i, j]]`` are dicts of
    columns, ``rows["name"]`` a column, ``__getitems__`` a list of rows (what ``datasets`` adds
    for torch's DataLoader), and iterating yields rows.
    """

    def __init__(self, **columns: torch.Tensor) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.columns[key]
        if isinstance(key, int):
            return {name: column[key] for name, column in self.columns.items()}
        if isinstance(key, (slice, list)):
            return {name: column[key] for name, column in self.columns.items()}
        raise TypeError(f"Rows cannot be indexed by {type(key).__name__}")

    def __getitems__(self, keys: list) -> list:
        batch = self[list(keys)]
        return [{name: values[i] for name, values in batch.items()} for i in range(len(keys))]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _token_rows(data: TokenData) -> Rows:
    return Rows(input_ids=data.ids, attention_mask=data.mask, labels=data.labels)


def _token_list(data: TokenData) -> list[dict]:
    return [data[i] for i in range(len(data))]


def _classifier() -> Model:
    torch.manual_seed(0)
    model = Model(TinyClassifier())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.5), metrics=Accuracy())
    return model


def _weights(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.parametrize("kind", [_token_rows, _token_list], ids=["datasets-like", "list-of-dicts"])
def test_map_style_data_and_lists_of_dicts_fit_evaluate_and_predict_like_a_dataset(kind):
    """The old code refused both: "train_data must be a torch.utils.data.Dataset ...; received
    Rows" (or list)."""
    data, held_out = TokenData(), TokenData(n=13, seed=1)
    reference = _classifier()
    reference_history = reference.fit(
        data, eval_data=held_out, batch_size=(8, 5), epochs=2, shuffle=False, verbose=0
    )
    model = _classifier()
    history = model.fit(
        kind(data), eval_data=kind(held_out), batch_size=(8, 5), epochs=2, shuffle=False, verbose=0
    )
    assert torch.equal(_weights(model.network), _weights(reference.network))
    assert torch.equal(
        _weights(model.network), _weights(hand_loop(data, batch=8, epochs=2, lr=0.5))
    )
    assert history.history == reference_history.history
    assert model.evaluate(kind(held_out), batch_size=4, verbose=0) == reference.evaluate(
        held_out, batch_size=4, verbose=0
    )
    (logits,) = model.predict(kind(held_out), batch_size=4, stack_outputs=True, verbose=0)
    (expected,) = reference.predict(held_out, batch_size=4, stack_outputs=True, verbose=0)
    assert torch.equal(logits, expected)


def test_a_shuffled_fit_over_map_style_data_reads_the_order_a_dataset_gets():
    data = TokenData()
    reference = _classifier()
    torch.manual_seed(3)
    reference.fit(data, batch_size=8, epochs=2, verbose=0)
    model = _classifier()
    torch.manual_seed(3)
    model.fit(_token_rows(data), batch_size=8, epochs=2, verbose=0)
    assert torch.equal(_weights(model.network), _weights(reference.network))


def test_a_list_of_tuples_trains_like_the_tensors_it_holds():
    x, y = make_tiny_data(50)
    runs = []
    for data in ((x, y), list(zip(x, y)), [(a.numpy(), int(b)) for a, b in zip(x, y)]):
        torch.manual_seed(0)
        model = Model(TinyNet())
        model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
        model.fit(data, batch_size=16, epochs=2, shuffle=False, verbose=0)
        runs.append(_weights(model.network))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


@pytest.mark.parametrize(
    "data, received",
    [
        ("train.csv", r"received str\."),
        (torch.zeros(8, 4), r"received a single Tensor float32\[8, 4\]\. Pass a tuple: \(x, y\)"),
        ({"x": torch.zeros(8, 4)}, r"received a dict with keys \['x'\]\. A mapping is one sample"),
        ([[1.0, 2.0], [3.0, 4.0]], r"received a list of 2 list\. A list is data when it holds"),
        ([], r"received a list of 0 nothing\."),
        (3, r"received int\."),
    ],
    ids=["string", "tensor", "dict", "list-of-lists", "empty-list", "int"],
)
def test_what_is_not_data_is_refused_naming_what_is_accepted_and_what_was_received(data, received):
    model = _classifier()
    accepted = (
        r"train_data must be a torch\.utils\.data\.Dataset or any map-style data set "
        r"\(__len__ and __getitem__\(int\), e\.g\. a Hugging Face datasets\.Dataset\), a list of "
        r"samples \(tuples or dicts\), an IterableDataset, a DataLoader, or a tuple of "
        r"tensors/NumPy arrays \(x, y\) of equal length; "
    )
    state = torch.get_rng_state()
    with pytest.raises(TypeError, match=accepted + received):
        model.fit(data, verbose=0)
    with pytest.raises(TypeError, match=accepted.replace("train_data", "eval_data") + received):
        model.fit(TokenData(), eval_data=data, verbose=0)
    assert torch.equal(torch.get_rng_state(), state)  # refused before the seed is drawn


# -- fit(batch_size=(train, eval)) -----------------------------------------------------------------


class BatchSizes(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.train: list[int] = []
        self.eval: list[int] = []

    def on_train_batch_end(self, step, logs=None):
        self.train.append(logs["batch_size"])

    def on_eval_batch_end(self, step, logs=None):
        self.eval.append(logs["batch_size"])


@pytest.mark.parametrize("pair", [(16, 40), [16, 40], (np.int64(16), 40)])
def test_a_pair_of_batch_sizes_batches_training_and_evaluation_apart(pair):
    """The old code refused a pair: "fit: batch_size must be a positive int; received (16, 40)"."""
    x, y = make_tiny_data(96)
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    sizes = BatchSizes()
    model.fit((x, y), eval_data=(x, y), batch_size=pair, callbacks=[sizes], verbose=0)
    assert sizes.train == [16] * 6
    assert sizes.eval == [40, 40, 16]
    assert sizes.params["batch_size"] == 16


@pytest.mark.parametrize(
    "batch_size, pattern",
    [
        (
            (0, 0),
            r"fit: batch_size must be a positive int or a pair \(train, eval\) of positive ints; "
            r"received \(0, 0\) \(tuple of 2\)\. Pass e\.g\. batch_size=\(32, 64\)",
        ),
        ((8, -1), r"received \(8, -1\) \(tuple of 2\)"),
        ((1, 2, 3), r"received \(1, 2, 3\) \(tuple of 3\)"),
        ((8,), r"received \(8,\) \(tuple of 1\)"),
        ([8, 2.0], r"received \[8, 2\.0\] \(list of 2\)"),
        ((True, 8), r"received \(True, 8\) \(tuple of 2\)"),
        (
            "32",
            r"fit: batch_size must be a positive int; received '32' \(str\)\. Pass e\.g\. "
            r"batch_size=1, or a pair \(train, eval\) of positive ints",
        ),
        (True, r"received True \(bool\)\. Pass e\.g\. batch_size=1, or a pair"),
    ],
)
def test_batch_sizes_other_than_an_int_or_a_pair_are_refused(batch_size, pattern):
    x, y = make_tiny_data(16)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match=pattern):
        model.fit((x, y), eval_data=(x, y), batch_size=batch_size, verbose=0)


@pytest.mark.parametrize("drop_last", [1, 0, None, np.bool_(True)])
def test_drop_last_takes_any_truth_value(drop_last):
    # 10 samples at batch 4: two batches with a true drop_last, three otherwise.
    x, y = make_tiny_data(10)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model.fit((x, y), batch_size=4, drop_last=drop_last, verbose=0)
    assert model.step == (2 if drop_last else 3)
