"""Figures under torchrun equal one process's exactly (tests/distributed/figures_script.py).

* Training figures are means over every sample of the epoch, on every rank: with lr=0
  they equal ``evaluate`` and the figures computed directly from the data, and not the
  last (short) global batch's, which holds all the mistakes.
* Evaluation shards: on 3 processes, 10 and 13 samples (``len % 3 == 1``, the sizes at
  which a shard overlapping its neighbour shows) with per-process batch sizes that do
  not divide the shards: ``evaluate`` equals one process, and ``predict`` returns every
  row once, in data-set order, on every rank.
* Only rank 0 opens a VisualDL writer (one record file, whatever the clock says).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from dist_helpers import read_ranks, torchrun

SCRIPT = pathlib.Path(__file__).resolve().parent / "figures_script.py"
REPO = SCRIPT.parents[2]
sys.path.insert(0, str(SCRIPT.parent))
import figures_script as fs  # noqa: E402


def assert_figures(actual, expected, prefix=""):
    assert set(actual) >= {prefix + name for name in expected}
    for name, value in expected.items():
        assert actual[prefix + name] == pytest.approx(value, rel=1e-6, abs=1e-6), prefix + name


def run(tmp_path, world):
    torchrun(["--standalone", f"--nproc_per_node={world}", str(SCRIPT), str(tmp_path)], timeout=300)
    ranks = read_ranks(tmp_path, "figures", world)
    for rank in ranks:  # the code under test is this checkout's, in every process
        assert pathlib.Path(rank["hapi_file"]).is_relative_to(REPO)
        assert pathlib.Path(rank["callbacks_file"]).is_relative_to(REPO)
    return ranks


def check_training_figures(ranks, world):
    samples = fs.TRAIN_PER_PROCESS * world
    network, x, y = fs.problem(samples, wrong=world)
    everything = fs.direct_figures(network, x, y)
    last_batch = fs.direct_figures(network, x[-world:], y[-world:])
    assert last_batch["acc"] == 0.0 and everything["acc"] == 0.8  # the data tell them apart
    assert last_batch["loss"] > everything["loss"] + 1.0
    global_batch = fs.PER_PROCESS_BATCH * world
    for rank in ranks:
        assert_figures(rank["evaluate_train"], everything)
        assert rank["history"]["loss"] == [pytest.approx(everything["loss"], rel=1e-6)] * 2
        for epoch in range(2):
            assert_figures({k: v[epoch] for k, v in rank["history"].items()}, everything)
            assert_figures(rank["epoch_end"][epoch], everything)
            assert_figures(rank["epoch_end"][epoch], everything, prefix="val_")
        # Batch logs (log_freq=1): running means over every process's samples so far.
        first_epoch = rank["batch_end"][:3]
        ends = [global_batch, 2 * global_batch, samples]
        assert [b["samples"] for b in first_epoch] == ends
        for batch_logs, end in zip(first_epoch, ends):
            assert_figures(batch_logs, fs.direct_figures(network, x[:end], y[:end]))
    assert ranks[0]["history"] == ranks[1]["history"]


def check_eval_shards(ranks):
    for samples, batch_size in fs.EVAL_CASES:
        network, x, y = fs.problem(samples, wrong=3)
        single = fs.prepared(network)
        expected = single.evaluate((x, y), batch_size=batch_size, verbose=0)
        assert_figures(expected, fs.direct_figures(network, x, y))
        rows = single.predict((x, y), batch_size=batch_size, stack_outputs=True, verbose=0)[0]
        torch.testing.assert_close(rows, 3.0 * x[:, :3])  # data-set order
        for rank in ranks:
            assert_figures(rank[f"evaluate_{samples}"], expected)
            assert len(rank[f"predict_{samples}"]) == samples
            torch.testing.assert_close(
                torch.tensor(rank[f"predict_{samples}"]), rows, atol=1e-6, rtol=0
            )


def check_only_rank_0_writes_visualdl(ranks, tmp_path):
    assert [rank["log_writers_opened"] for rank in ranks] == [1] + [0] * (len(ranks) - 1)
    assert len(list((tmp_path / "vdl" / "version_0").glob("vdlrecords.*"))) == 1


def test_two_processes_report_the_figures_of_one(tmp_path):
    ranks = run(tmp_path, 2)
    check_training_figures(ranks, 2)
    check_eval_shards(ranks)
    check_only_rank_0_writes_visualdl(ranks, tmp_path)


def test_three_processes_shard_uneven_data_without_overlap(tmp_path):
    ranks = run(tmp_path, 3)
    check_eval_shards(ranks)
    check_training_figures(ranks, 3)
    check_only_rank_0_writes_visualdl(ranks, tmp_path)
