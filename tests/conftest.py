"""Shared fixtures: a tiny learnable problem and a network that fits it in a few steps."""

from __future__ import annotations

import os
import pathlib
import socket
import warnings

import pytest
import torch
from torch import nn

from callbacks import Callback
from hapi import Model

# One torch thread in each test process. The suite runs three test processes at once
# (pytest-xdist, ``-n 3`` in pyproject.toml) on a 2-core machine, and each multi-process
# test starts its own one-thread processes besides: more intra-op threads than cores make
# OpenMP's threads spin-wait for each other, which tripled the CPU time of the in-process
# tests (tests/callbacks and test_fuzz: 204 s -> 69 s of CPU). The tests' tensors are tiny.
torch.set_num_threads(1)


class TinyNet(nn.Module):
    """Two features -> three classes; small enough to train in milliseconds."""

    def __init__(self, in_features: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.hidden = nn.Linear(in_features, 16)
        self.out = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def make_tiny_data(n: int = 96, in_features: int = 4, classes: int = 3, seed: int = 0):
    """Separable data: the class is the index of the largest of the first `classes` features."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=generator)
    y = x[:, :classes].argmax(dim=1)
    return x, y


def tiny_model(
    lr: float = 0.1,
    metrics=None,
    *,
    seed: int = 0,
    momentum: float = 0.0,
    adam: bool = False,
    loss=None,
    device=None,
    network=None,
    **prepare,
) -> Model:
    """The suite's small model: ``TinyNet()`` (or ``network()``) built under
    ``torch.manual_seed(seed)``, prepared with SGD at ``lr`` (Adam with ``adam=True``), the
    loss (cross-entropy by default), ``metrics`` and any other ``prepare`` keyword."""
    torch.manual_seed(seed)
    model = Model(TinyNet() if network is None else network(), device=device)
    parameters = model.parameters()
    optimizer = (
        torch.optim.Adam(parameters, lr)
        if adam
        else torch.optim.SGD(parameters, lr=lr, momentum=momentum)
    )
    model.prepare(optimizer, nn.CrossEntropyLoss() if loss is None else loss, metrics, **prepare)
    return model


@pytest.fixture
def tiny_data():
    return make_tiny_data()


@pytest.fixture
def tiny_net():
    torch.manual_seed(0)
    return TinyNet()


class Recorder(Callback):
    """Records every hook call as (hook, argument, sorted logs keys)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def _record(self, hook, arg=None, logs=None):
        self.calls.append((hook, arg, tuple(sorted(logs or {}))))

    def on_train_begin(self, logs=None):
        self._record("on_train_begin", logs=logs)

    def on_train_end(self, logs=None):
        self._record("on_train_end", logs=logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._record("on_epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._record("on_epoch_end", epoch, logs)

    def on_train_batch_begin(self, step, logs=None):
        self._record("on_train_batch_begin", step, logs)

    def on_before_optimizer_step(self, step, logs=None):
        self._record("on_before_optimizer_step", step, logs)

    def on_train_batch_end(self, step, logs=None):
        self._record("on_train_batch_end", step, logs)

    def on_eval_begin(self, logs=None):
        self._record("on_eval_begin", logs=logs)

    def on_eval_end(self, logs=None):
        self._record("on_eval_end", logs=logs)

    def on_eval_batch_begin(self, step, logs=None):
        self._record("on_eval_batch_begin", step, logs)

    def on_eval_batch_end(self, step, logs=None):
        self._record("on_eval_batch_end", step, logs)

    def on_predict_begin(self, logs=None):
        self._record("on_predict_begin", logs=logs)

    def on_predict_end(self, logs=None):
        self._record("on_predict_end", logs=logs)

    def on_predict_batch_begin(self, step, logs=None):
        self._record("on_predict_batch_begin", step, logs)

    def on_predict_batch_end(self, step, logs=None):
        self._record("on_predict_batch_end", step, logs)


@pytest.fixture
def recorder():
    return Recorder()


@pytest.fixture
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The slowest files first (measured with --durations on this 2-core machine). The test
# processes take whole files in collection order (``--dist loadfile``), and the top-level
# files, collected last, hold some of the slowest (Ray's start, the GPU check on the CPU, the
# benchmark scripts): taken last, one process worked through them alone at the end.
_SLOWEST_FILES = (
    "tests/distributed/test_resume_matrix.py",
    "tests/test_benchmarks.py",
    "tests/test_ray_train.py",
    "tests/test_gpu_check.py",
    "tests/distributed/test_spawn.py",
    "tests/distributed/test_two_hosts.py",
    "tests/examples/test_hapitrain.py",
    "tests/test_docs_build.py",
    "tests/test_typecheck.py",
)


def pytest_collection_modifyitems(config, items):
    first = {path: rank for rank, path in enumerate(_SLOWEST_FILES)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))


_OURS = tuple(
    str(pathlib.Path(__file__).resolve().parents[1] / name) + os.sep
    for name in ("hapi", "callbacks")
)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Every warning of every test points at the line that called torch-hapi, never into
    hapi/ or callbacks/, where a user can do nothing about it (hapi.messages.warn)."""
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always")
            try:
                result = yield
            finally:
                caught = list(recorded)
    finally:  # on to pytest's own record of the test's warnings
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    # A ResourceWarning comes from the garbage collector, at whatever line it happened to run.
    ours = [
        w
        for w in caught
        if os.path.abspath(w.filename).startswith(_OURS) and w.category is not ResourceWarning
    ]
    assert not ours, "warnings attributed to torch-hapi's own code:\n" + "\n".join(
        f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in ours
    )
    return result
