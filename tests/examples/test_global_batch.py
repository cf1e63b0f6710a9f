"""examples/global_batch.py prints the same figures on 1 process at batch 32 and on 2 at 16.

The distributed guide shows the two commands and their one JSON line each; this
runs them as printed there (torchrun with two Gloo processes) and compares.
"""

from __future__ import annotations

import pathlib

from dist_helpers import child_env, main_process_report, run_python, torchrun

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "global_batch.py"


def test_two_processes_at_half_the_batch_equal_one_at_the_global_batch(tmp_path):
    one = run_python([str(EXAMPLE), "--batch-size", "32"], 120, child_env(), cwd=tmp_path)
    assert one.returncode == 0, one.stdout + one.stderr
    two = torchrun(["--standalone", "--nproc_per_node=2", str(EXAMPLE), "--batch-size", "16"])
    alone, together = main_process_report(one.stdout), main_process_report(two.stdout)
    assert (alone["processes"], together["processes"]) == (1, 2)
    assert alone["global_batch"] == together["global_batch"] == 32
    assert alone.keys() == together.keys()
    for name in ("loss", "acc", "weights_sum", "weights_abs_sum"):
        assert abs(alone[name] - together[name]) < 1e-5, (name, alone, together)
