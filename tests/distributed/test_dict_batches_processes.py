"""Dict batches on 2 processes at batch b train and score like 1 process at 2b."""

from __future__ import annotations

import json

import pytest
from dist_helpers import WORKER, assert_close_lists, child_env, read_ranks, run_python, torchrun

SCRIPT = WORKER.parent / "dict_script.py"


def test_dict_batches_on_two_processes_equal_one_at_the_global_batch(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    result = run_python([str(SCRIPT), str(one), "16"], 120, child_env())
    assert result.returncode == 0, result.stderr[-3000:]
    reference = json.loads((one / "dict.rank0.json").read_text())
    torchrun(["--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path), "8"])
    ranks = read_ranks(tmp_path, "dict", 2)
    for rank in ranks:
        assert_close_lists(rank["weights"], reference["weights"], atol=1e-6)
        assert set(rank["history"]) == {"loss", "acc", "val_loss", "val_acc", "lr"}
        for name, values in reference["history"].items():
            assert rank["history"][name] == pytest.approx(values, rel=1e-5), name
        assert rank["evaluate"] == pytest.approx(reference["evaluate"], rel=1e-5)
