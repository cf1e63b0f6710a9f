"""Errors a user meets when the distributed environment is wrong."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch
from dist_helpers import child_env

from hapi import distributed
from hapi.data import EpochBatches, permutation
from hapi.distributed.group import backend_name


def test_a_port_in_use_names_the_address_and_the_fix():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                "import torch; from hapi import Model; Model(torch.nn.Linear(1, 1))",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
        )
    assert result.returncode != 0
    assert (
        f"DistributedSetupError: Could not join the gloo process group at 127.0.0.1:{port}"
        in result.stderr
    )
    assert "another program already listens on that port" in result.stderr


def test_nccl_without_cuda_is_refused_with_advice(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine
    monkeypatch.setenv("HAPI_BACKEND", "nccl")
    with pytest.raises(distributed.DistributedSetupError, match="NCCL, which needs CUDA GPUs"):
        backend_name()


def test_the_backend_follows_the_models_device(monkeypatch):
    monkeypatch.delenv("HAPI_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend_name() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    assert backend_name() == "nccl"  # the default device is then CUDA
    assert backend_name(torch.device("cuda", 0)) == "nccl"
    # Model(net, device="cpu") on a GPU machine: NCCL cannot reduce CPU tensors.
    assert backend_name("cpu") == "gloo"
    monkeypatch.setenv("HAPI_BACKEND", "nccl")
    with pytest.raises(
        distributed.DistributedSetupError,
        match=r"reduces CUDA tensors only, but the Model was given device='cpu'",
    ):
        backend_name("cpu")


def test_an_incomplete_environment_says_what_is_missing(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        distributed.DistributedSetupError, match="RANK, MASTER_ADDR, MASTER_PORT are not set"
    ):
        distributed.init()


def test_contiguous_eval_shards_cover_every_sample_once():
    shards = [
        [
            i
            for batch in EpochBatches(
                permutation(1001, False),
                1001,
                batch_size=500,
                training=False,
                num_replicas=3,
                rank=r,
            )
            for i in batch
        ]
        for r in range(3)
    ]
    assert [len(s) for s in shards] == [334, 334, 333]
    assert sum(shards, []) == list(range(1001))
