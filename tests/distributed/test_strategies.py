"""prepare(strategy=...): DDP's options, and strategies that are no-ops on one process."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from dist_helpers import WORKER, assert_close_lists, read_ranks, torchrun
from torch import nn

import hapi
from hapi.distributed import resolve_strategy

SCRIPT = WORKER.parent / "strategies_script.py"


def test_ddp_options_on_two_processes(tmp_path):
    torchrun(["--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path)])
    ranks = read_ranks(tmp_path, "strategies", 2)
    sys.path.insert(0, str(SCRIPT.parent))
    import strategies_script  # noqa: PLC0415

    one_process = strategies_script.weights(strategies_script.train(16))
    for rank in ranks:
        # The default strategy names the option that fixes it, and does not blame the inputs.
        assert "find_unused_parameters=True" in rank["default"]
        assert "WithUnusedBranch" in rank["default"] and "shape and dtype" not in rank["default"]
        # With it, 2 processes at batch 8 train like one at 16 (the unused head stays put).
        assert_close_lists(rank["find_unused"], one_process)
        # SyncBatchNorm runs on GPU modules only: a CPU process is told so, before training.
        assert rank["sync_batchnorm"].startswith("DistributedSetupError")
        assert "runs only on GPU modules" in rank["sync_batchnorm"]
        # A keyword DistributedDataParallel lacks gets DDP's own TypeError, naming it.
        assert "DistributedDataParallel" in rank["unknown_keyword"]
        assert "unexpected keyword argument 'device'" in rank["unknown_keyword"]


@pytest.mark.parametrize(
    "strategy",
    [
        None,
        "auto",
        "ddp",
        "fsdp",
        hapi.DDP(static_graph=True),
        hapi.FSDP(reshard_after_forward=False),
    ],
)
def test_every_strategy_is_a_no_op_on_one_process(strategy):
    torch.manual_seed(0)
    model = hapi.Model(TinyNet())
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), strategy=strategy
    )
    model.fit(make_tiny_data(32), batch_size=8, verbose=0)
    torch.manual_seed(0)
    plain = hapi.Model(TinyNet())
    plain.prepare(torch.optim.SGD(plain.parameters(), lr=0.1), nn.CrossEntropyLoss())
    plain.fit(make_tiny_data(32), batch_size=8, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    assert type(model.network) is TinyNet


def test_strategy_errors_say_what_is_accepted():
    with pytest.raises(
        ValueError, match=r"strategy must be 'auto', 'ddp' or 'fsdp'.*received 'deepspeed'"
    ):
        resolve_strategy("deepspeed")
    with pytest.raises(TypeError, match=r"strategy must be None, 'auto'.*received int"):
        resolve_strategy(3)
    with pytest.raises(TypeError, match=r"hapi.DDP sets device_ids itself"):
        hapi.DDP(device_ids=[0])
    with pytest.raises(
        TypeError, match=r"hapi.FSDP\(wrap=...\) takes a set of nn.Module classes.*received 3"
    ):
        hapi.FSDP(wrap=3)
    assert resolve_strategy(hapi.DDP(find_unused_parameters=True)).find_unused_parameters


def test_another_strategy_after_training_is_refused(monkeypatch):
    model = hapi.Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model.fit(make_tiny_data(16), batch_size=8, verbose=0)
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        strategy=hapi.DDP(static_graph=True),
    )  # one process: nothing was wrapped, any goes
    model._wrapped = nn.Identity()  # stands for the DDP wrapper several processes build
    monkeypatch.setattr(hapi.model.distributed, "world_size", lambda: 2)
    with pytest.raises(
        RuntimeError, match=r"after this Model trained with hapi.DDP.*Build a new Model"
    ):
        model.prepare(
            torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), strategy="ddp"
        )
