"""The loop's parity items on 2 processes (tests/distributed/loop_items_script.py).

* A network with every parameter frozen trains under DDP (not wrapped: DDP refuses a module
  with nothing to train): one warning per process, the loss reported, nothing updated.
* ``stop_evaluating`` / ``stop_predicting`` set by a callback on rank 0 only: every rank
  ends after the same batch (agreed every ``log_freq`` batches; 10 for ``predict``), and
  the evaluation's figures cover exactly the samples every rank saw.
* A step's ``"weight"``: the epoch's figures are sums over every process's weights.
"""

from __future__ import annotations

import pathlib

import pytest
from dist_helpers import read_ranks, torchrun

SCRIPT = pathlib.Path(__file__).resolve().parent / "loop_items_script.py"


def test_frozen_networks_stops_and_weights_on_two_processes(tmp_path):
    torchrun(["--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path)], timeout=240)
    ranks = read_ranks(tmp_path, "loop_items", 2)
    for rank in ranks:
        assert len(rank["frozen_warnings"]) == 1 and rank["frozen_unchanged"]
        assert rank["frozen_loss"] == [pytest.approx(rank["frozen_expected"], rel=1e-5)] * 2
        # log_freq=1: after the very batch; log_freq=2: at the next agreement, batch 1.
        assert rank["eval_1"]["steps"] == [0] and rank["eval_2"]["steps"] == [0, 1]
        # predict agrees every 10 batches (the log_freq its progress bar uses).
        assert rank["predict"]["steps"] == list(range(10))
        weighted = rank["weighted"]
        assert weighted["loss"] == [pytest.approx(weighted["expected"], rel=1e-6)]
        assert weighted["val_loss"] == [pytest.approx(weighted["expected"], rel=1e-6)]
    for name in ("eval_1", "eval_2"):
        seen = ranks[0][name]["seen"] + ranks[1][name]["seen"]
        assert len(seen) == 4 * len(ranks[0][name]["steps"]) * 2
        for rank in ranks:  # the mean over every sample any rank saw, nothing else
            assert rank[name]["loss"] == pytest.approx(sum(seen) / len(seen), rel=1e-6)
    rows = ranks[0]["predict"]["rows"]
    assert rows == ranks[1]["predict"]["rows"] and len(rows) == 80
