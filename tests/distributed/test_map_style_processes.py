"""Map-style data (no torch Dataset) and lists of dict samples on 2 processes at batch b train
and score like 1 process at 2b: they are sharded exactly like a Dataset."""

from __future__ import annotations

import json

import pytest
from dist_helpers import WORKER, assert_close_lists, child_env, read_ranks, run_python, torchrun

SCRIPT = WORKER.parent / "map_style_script.py"


def test_map_style_data_on_two_processes_equals_one_at_the_global_batch(tmp_path):
    """The old code refused both kinds of data on any number of processes."""
    one = tmp_path / "one"
    one.mkdir()
    result = run_python([str(SCRIPT), str(one), "16"], 120, child_env())
    assert result.returncode == 0, result.stderr[-3000:]
    reference = json.loads((one / "map_style.rank0.json").read_text())
    torchrun(["--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path), "8"])
    for rank in read_ranks(tmp_path, "map_style", 2):
        assert_close_lists(rank["weights"], reference["weights"], atol=1e-6)
        for name, values in reference["history"].items():
            assert rank["history"][name] == pytest.approx(values, rel=1e-5), name
        for data, figures in reference["evaluate"].items():
            assert rank["evaluate"][data] == pytest.approx(figures, rel=1e-5), data
        assert_close_lists(rank["predict"], reference["predict"], atol=1e-6)
    evaluations = list(reference["evaluate"].values())
    assert evaluations[0] == evaluations[1] == evaluations[2]  # rows, list, Dataset alike
