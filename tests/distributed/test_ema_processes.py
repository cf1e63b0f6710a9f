"""EMA under DDP: every process holds the same average, the one a single process gets at the global batch."""

from __future__ import annotations

import sys

import pytest
from dist_helpers import WORKER, assert_close_lists, read_ranks, torchrun

SCRIPT = WORKER.parent / "ema_script.py"


def test_two_processes_average_like_one_at_the_global_batch(tmp_path):
    torchrun(["--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path)], BATCH_SIZE="8")
    ranks = read_ranks(tmp_path, "ema", 2)
    sys.path.insert(0, str(WORKER.parent))
    import ema_script  # noqa: PLC0415

    reference = ema_script.run(batch_size=16)  # one process, here, at the global batch
    assert ranks[0]["step"] == ranks[1]["step"] == reference["step"] == 8
    # The same average on every process, bit for bit, with no communication of its own...
    assert ranks[0]["average"] == ranks[1]["average"]
    # ...which is one process's at twice the batch, and what evaluation scored.
    assert_close_lists(ranks[0]["average"], reference["average"], atol=1e-5)
    assert ranks[0]["average"] != ranks[0]["weights"]
    for rank in ranks:
        assert rank["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)
