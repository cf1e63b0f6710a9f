"""The same script on several processes (torchrun, Gloo on CPU): exact, not just running."""

from __future__ import annotations

import csv
import pathlib
import time

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from dist_helpers import (
    WORKER,
    assert_close_lists,
    read_ranks,
    single_process_weights,
    torchrun,
    two_machines,
)

from hapi import Model
from hapi.metrics import Accuracy


def test_two_processes_train_like_one_at_twice_the_batch(tmp_path):
    result = torchrun(["--standalone", "--nproc_per_node=2", str(WORKER), "train", str(tmp_path)])
    ranks = read_ranks(tmp_path, "train", 2)
    expected = single_process_weights()
    for rank in ranks:
        # Dataset, a plain DataLoader (resharded), one with its own DistributedSampler,
        # and gradient accumulation (batch 4 x 2): all equal one process at batch 16.
        for key in (
            "dataset",
            "loader",
            "loader_with_sampler",
            "loader_with_batch_sampler",
            "accumulate",
        ):
            assert_close_lists(rank[key], expected)
        assert rank["network_type"] == "TinyNet"  # model.network is never the DDP wrapper
        # CPU processes on one machine average gradients through shared memory, not TCP.
        assert rank["comm_hooks"] == ["average_hook"]
    assert (
        "Distributed training on 2 processes: batch_size 8 per process, global batch 16"
        in result.stdout
    )
    assert result.stdout.count("Epoch 1/2") == 1  # only rank 0 prints
    assert "Eval samples: 21" in result.stdout  # 11 + 10: every process's samples, counted once
    assert ranks[0]["evaluate_21"] == ranks[1]["evaluate_21"]

    # The loss turns NaN on rank 1 only (its 3rd batch): figures are reduced, so
    # TerminateOnNaN stops both ranks at the same step, and rank 0 says where.
    assert ranks[0]["nan_stop"] == ranks[1]["nan_stop"] == {"epochs": [0], "step": 3}
    assert "Epoch 1, step 3: loss is nan; stopping training (TerminateOnNaN)." in result.stdout

    # Shuffling: every epoch, the ranks read disjoint halves covering all samples, reshuffled.
    epochs = [
        sorted(a + b) for a, b in zip(ranks[0]["shuffled_indices"], ranks[1]["shuffled_indices"])
    ]
    assert epochs == [list(range(64))] * 2
    assert not set(ranks[0]["shuffled_indices"][0]) & set(ranks[1]["shuffled_indices"][0])
    assert ranks[0]["shuffled_indices"][0] != ranks[0]["shuffled_indices"][1]
    assert ranks[0]["shuffled_weights"] == ranks[1]["shuffled_weights"]
    assert ranks[0]["shuffled_history"] == ranks[1]["shuffled_history"]  # figures reduced alike

    # A stop request on rank 1 alone stops every rank; early stopping decides alike.
    assert ranks[0]["stopped_epochs"] == ranks[1]["stopped_epochs"] == [0]
    # ... also when only rank 0 has the batch callback that asks (at step 1, seen at the
    # log_freq=2 boundary): both ranks stop after 2 steps, with the same figures.
    assert ranks[0]["rank0_callback_stop"] == ranks[1]["rank0_callback_stop"]
    assert ranks[0]["rank0_callback_stop"]["epochs"] == [0]
    assert ranks[0]["rank0_callback_stop"]["step"] == 2
    assert ranks[0]["early_stop_epochs"] == ranks[1]["early_stop_epochs"] == [0, 1]
    assert ranks[0]["val_history"] == ranks[1]["val_history"]

    # Only rank 0 wrote files: one VisualDL record, one CSV, plain checkpoints.
    assert len(list((tmp_path / "vdl" / "version_0").glob("vdlrecords.*"))) == 1
    assert [row["epoch"] for row in csv.DictReader(open(tmp_path / "log.csv"))] == ["0", "1"]
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == {
        "0.pt",
        "1.pt",
        "best.pt",
        "final.pt",
    }
    state = torch.load(tmp_path / "final.pt", weights_only=True)
    assert not any(key.startswith("module.") for key in state["network"])
    single = Model(TinyNet())
    single.load(tmp_path / "final")  # a DDP run's checkpoint loads into one process
    assert_close_lists(
        torch.cat([p.detach().flatten() for p in single.parameters()]).tolist(),
        ranks[0]["saved_weights"],
        atol=0,
    )


def test_three_processes_evaluate_predict_and_train_exactly_like_one(tmp_path):
    torchrun(["--standalone", "--nproc_per_node=3", str(WORKER), "eval", str(tmp_path)])
    ranks = read_ranks(tmp_path, "eval", 3)
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(
        torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(), Accuracy()
    )
    x, y = make_tiny_data(1001)
    expected = model.evaluate((x, y), batch_size=3, verbose=0)
    predictions = model.predict((x, y), batch_size=3, stack_outputs=True, verbose=0)[0]
    two = model.evaluate((x[:2], y[:2]), batch_size=3, verbose=0)
    for rank in ranks:  # 1001 = 334 + 334 + 333 samples: no duplicate, none missing
        assert rank["evaluate"]["acc"] == expected["acc"]
        assert rank["evaluate"]["loss"] == pytest.approx(expected["loss"], rel=1e-6)
        assert rank["evaluate_batch_sampler"]["acc"] == expected["acc"]
        assert rank["evaluate_batch_sampler"]["loss"] == pytest.approx(expected["loss"], rel=1e-6)
        assert_close_lists(rank["predict"], predictions.tolist(), atol=1e-6)
        assert rank["predict_batches_rows"] == 1001
        # 2 samples on 3 processes: rank 2's shard is empty, nothing hangs or fails.
        assert rank["evaluate_2"]["loss"] == pytest.approx(two["loss"], rel=1e-6)
        assert rank["evaluate_2"]["acc"] == two["acc"]
        own = rank["evaluate_2_own_step"]  # names logged only where a batch ran
        assert own == pytest.approx({"loss": two["loss"], "doubled": 2 * two["loss"]}, rel=1e-6)
        assert_close_lists(rank["predict_2"], predictions[:2].tolist(), atol=1e-6)
    # Three processes at batch 8 train like one at 24 (rank r reads samples r, r+3, ...,
    # so each step's three batches are the single process's batch), with the shared-memory
    # average, on more processes than cores.
    torch.manual_seed(0)
    single = Model(TinyNet())
    single.prepare(
        torch.optim.SGD(single.parameters(), lr=0.1), torch.nn.CrossEntropyLoss(), Accuracy()
    )
    single.fit((x[:48], y[:48]), batch_size=24, epochs=2, shuffle=False, verbose=0)
    expected_weights = torch.cat([p.detach().flatten() for p in single.parameters()]).tolist()
    for rank in ranks:
        assert rank["comm_hooks"] == ["average_hook"]
        assert_close_lists(rank["trained_48"], expected_weights)
        assert rank["broadcast"] == list(range(100))  # rank 0's bytes, everywhere
        assert rank["broadcast_nothing"] is None  # rank 0 had none: nobody has any
        assert rank["broadcast_from_2"] == "from 2"
        # A resume's backup, each rank's folder standing for a machine of its own: the copy
        # furthest into training reaches everyone, wherever it lies; a damaged one stops all.
        assert "No process found a checkpoint" in rank["freshest"]["none"]
        assert rank["freshest"]["latest"] == [6, 1]
    assert "truncated or corrupt" in ranks[2]["freshest"]["damaged"]
    for rank in ranks[:2]:  # every process stops, not only the one whose copy is damaged
        assert "Rank 2 could not read its copy" in rank["freshest"]["damaged"]


def test_too_little_shared_memory_falls_back_to_gloo_on_every_rank(tmp_path):
    before = set(pathlib.Path("/dev/shm").glob("hapi-allreduce-*"))  # other jobs' are not ours
    torchrun(
        ["--standalone", "--nproc_per_node=2", str(WORKER), "train_small", str(tmp_path)],
        WORKER_SHM_FULL="1",
    )
    for rank in read_ranks(tmp_path, "train_small", 2):
        assert rank["comm_hooks"] == []  # rank 0 could not reserve the buffer: nobody uses it
        for key in ("dataset", "loader", "accumulate"):
            assert_close_lists(rank[key], single_process_weights())
    assert set(pathlib.Path("/dev/shm").glob("hapi-allreduce-*")) <= before  # nothing left behind


def test_two_machines_with_a_c10d_rendezvous(tmp_path, free_port):
    two_machines(
        free_port, "hapi-test", [[str(WORKER), "train_small", str(tmp_path)]] * 2, timeout=150
    )
    for rank in read_ranks(tmp_path, "train_small", 2):
        for key in (
            "dataset",
            "loader",
            "loader_with_sampler",
            "loader_with_batch_sampler",
            "accumulate",
        ):
            assert_close_lists(rank[key], single_process_weights())
        assert rank["comm_hooks"] == []  # processes on different "machines": Gloo's all-reduce


def test_a_rank_that_raises_stops_the_job_with_its_error(tmp_path):
    started = time.monotonic()
    result = torchrun(
        ["--standalone", "--nproc_per_node=2", str(WORKER), "fail", str(tmp_path)],
        check=False,
        timeout=90,
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert "boom on rank 1 at step 2" in result.stdout + result.stderr
    assert elapsed < 60  # rank 0, waiting in DDP's all-reduce, was stopped, not left hanging


def test_a_process_group_the_user_created_is_reused_and_left_alone(tmp_path):
    torchrun(["--standalone", "--nproc_per_node=2", str(WORKER), "user_group", str(tmp_path)])
    for rank in read_ranks(tmp_path, "user_group", 2):
        assert rank["same_group"] and rank["still_initialized"]
        assert_close_lists(rank["weights"], single_process_weights())
