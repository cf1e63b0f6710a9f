"""Splitting a batch into the network's inputs and the loss's labels, and moving it to the device.

Tuple batches split by position (``Model(inputs=, labels=)``), dict batches
(the Hugging Face convention) by key -- also any other ``Mapping``, such as
transformers' ``BatchEncoding`` or the ``UserDict`` a data collator returns;
see :class:`BatchSplitter`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch


def _count(value: Any, name: str) -> int | None:
    """``inputs=``/``labels=``: a count, or a sequence (names, specs) whose length counts."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, Sequence)) or isinstance(value, str):
        raise TypeError(
            f"{name} must be the number of {name} per sample (an int) or a list of them "
            f"(names or specs, one per {name[:-1]}); received {value!r}."
        )
    count, least = (value if isinstance(value, int) else len(value)), int(name == "inputs")
    if count < least:
        raise ValueError(f"{name} must count at least {least}; received {value!r}.")
    return count


class KeywordInputs(dict):
    """The network inputs of a dict batch: the network is called as ``network(**inputs)``."""


# Where Hugging Face data sets keep the targets, in the order looked for.
DEFAULT_LABEL_KEYS = ("labels", "label")


@dataclass(eq=False)
class BatchSplitter:
    """Splits a batch into ``(inputs, labels)`` and moves them to the device.

    A tuple batch is split by position (``Model(inputs=, labels=)`` counts).
    A dict batch (the Hugging Face convention), or any other ``Mapping``
    (``BatchEncoding``, ``UserDict``), is split by key: the label keys
    (``Model(labels=[names])``, by default ``"labels"``, else ``"label"``)
    go to the loss and metrics, every other key to the network as a keyword
    argument; with ``labels_to_network`` (no loss given to ``prepare``) the
    label keys go to the network too, which then computes its own loss.
    """

    device: torch.device
    n_inputs: int | None
    n_labels: int | None
    label_keys: Sequence[str] | None = None
    labels_to_network: bool = False

    @classmethod
    def for_model(cls, device: torch.device, inputs: Any, labels: Any) -> "BatchSplitter":
        """From ``Model(inputs=, labels=)``: counts, or lists whose length counts (label names
        also name a dict batch's label keys)."""
        counts = _count(inputs, "inputs"), _count(labels, "labels")  # int or list: checked
        names = not isinstance(labels, int) and labels and all(isinstance(k, str) for k in labels)
        return cls(device, *counts, list(labels) if names else None)

    def user_batch(self, inputs: Any, labels: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``train_batch``'s inputs and labels (tensors or arrays, one or a list) on the device."""
        return self._user_tensors(inputs, "inputs"), self._user_tensors(labels, "labels")

    def _user_tensors(self, values: Any, name: str) -> list[torch.Tensor]:
        items = [] if values is None else values if isinstance(values, (list, tuple)) else [values]
        tensors = [torch.from_numpy(i) if isinstance(i, np.ndarray) else i for i in items]
        for item in tensors:
            if not torch.is_tensor(item):
                raise TypeError(
                    f"{name} must be tensors or NumPy arrays (or a list of them); received "
                    f"{type(item).__name__}."
                )
        return self._to_device(tensors)

    def _to_device(self, items: Iterable[Any]) -> list[Any]:
        non_blocking = self.device.type == "cuda"
        return [
            item.to(self.device, non_blocking=non_blocking) if torch.is_tensor(item) else item
            for item in items
        ]

    def split(self, batch: Any, need_labels: bool = True) -> tuple[list[Any], list[Any]]:
        """A batch already on the device (:meth:`to_device`) as ``(inputs, labels)``."""
        if not isinstance(batch, (tuple, list)):  # tuples first: the common case costs one check
            if isinstance(batch, dict) or isinstance(batch, Mapping):  # dict: no ABC check
                return self._split_dict(batch, need_labels)
            return [batch], []
        batch, first_label = list(batch), self.n_inputs
        if first_label is None:
            n = len(batch)
            first_label = max(n - 1, 1) if self.n_labels is None else n - self.n_labels
        inputs, labels = batch[:first_label], batch[first_label:][: self.n_labels]
        if need_labels and (self.n_labels or 0) > len(labels):
            raise ValueError(
                f"A batch has {len(batch)} elements but Model(inputs={self.n_inputs}, labels="
                f"{self.n_labels}) asks for more; give the data's items that many of each."
            )
        if not inputs:
            raise ValueError(
                f"A batch of {len(batch)} elements leaves no network inputs with "
                f"Model(inputs={self.n_inputs}, labels={self.n_labels})."
            )
        return inputs, (labels if need_labels else [])

    def to_device(self, batch: Any) -> Any:
        """The batch on the device, its structure kept (what every step receives)."""
        if isinstance(batch, (tuple, list)):
            moved = self._to_device(batch)
            return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
        if not isinstance(batch, Mapping):
            return self._to_device([batch])[0]  # a tensor, or left as it is
        moved = dict(zip(batch, self._to_device(batch.values())))
        try:  # keep the user's type (UserDict, BatchEncoding) where it takes a dict
            return moved if type(batch) is dict else type(batch)(moved)
        except TypeError:
            return moved

    @staticmethod
    def length(batch: Any) -> int:
        """Samples in a whole batch (tuple, mapping or tensor)."""
        if isinstance(batch, Mapping):
            return batch_length(list(batch.values()), [])
        return batch_length(list(batch) if isinstance(batch, (tuple, list)) else [batch], [])

    def _split_dict(self, batch: Mapping, need_labels: bool) -> tuple[list[Any], list[Any]]:
        keys = self.label_keys
        missing = [key for key in keys or [] if key not in batch]
        if keys is None:
            keys = [key for key in DEFAULT_LABEL_KEYS if key in batch][:1]
        elif need_labels and missing:
            guess = [k for k in sorted(batch) if "label" in k] or ["labels"]
            raise KeyError(
                f"A batch is a {type(batch).__name__} with keys {sorted(batch)}, without the label "
                f"keys {missing} that Model(labels={keys}) names. Name the keys your data set "
                f"returns, e.g. Model(network, labels={guess})."
            )
        features = {k: v for k, v in batch.items() if self.labels_to_network or k not in keys}
        if not features:
            raise ValueError(
                f"A {type(batch).__name__} batch with keys {sorted(batch)} leaves no network "
                f"inputs: every key is a label key ({keys})."
            )
        labels = [batch[key] for key in keys if key in batch] if need_labels else []
        return [KeywordInputs(features)], labels


def batch_length(inputs: list[Any], labels: list[Any]) -> int:
    """Samples in a batch: the first dimension of its first tensor (the labels' first)."""
    for item in labels:
        if torch.is_tensor(item) and item.ndim > 0:
            return int(item.shape[0])
    for item in inputs:
        for value in item.values() if isinstance(item, KeywordInputs) else [item]:
            if torch.is_tensor(value) and value.ndim > 0:
                return int(value.shape[0])
    return 1
