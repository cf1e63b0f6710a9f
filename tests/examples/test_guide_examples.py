"""The guides' multi-process examples (examples/guide_*.py) run under torchrun with 2 processes."""

from __future__ import annotations

import json
import pathlib

from dist_helpers import torchrun

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_guide_callbacks_ranks_every_process_sees_the_same_and_stops_together(tmp_path):
    done = torchrun(
        [
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "examples" / "guide_callbacks_ranks.py"),
            "--output",
            str(tmp_path),
        ],
        OMP_NUM_THREADS="1",
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1]
    # rank 1 alone set stop_training after batch 2 of epoch 2: both stopped there (4 + 2)
    assert [r["batches"] for r in ranks] == [6, 6]
    assert [r["steps"] for r in ranks] == [6, 6]
    assert ranks[0]["epoch_logs"] == ranks[1]["epoch_logs"]  # the same figures everywhere
    assert len(ranks[0]["epoch_logs"]) == 2
    printed = done.stdout.splitlines()
    # the main process alone prints the report (once per line, not once per process)
    assert printed.count("2 processes, 4 batches of 8 per process and epoch") == 1
    assert printed.count("stopped after 6 batches on each process") == 1
    assert sum(line.startswith("epoch ") for line in printed) == 2
