"""A run that trained to the end is reported as finished.

Destroying a Gloo group while a peer still uses it can abort the process at exit
("terminate called without an active exception"), so torchrun reports a finished job as
FAILED. The processes must leave together: the one that is done first waits for the others.
"""

from __future__ import annotations

from dist_helpers import WORKER, read_ranks, torchrun

SCRIPT = WORKER.parent / "teardown_script.py"


def test_the_first_process_done_waits_for_the_others_before_leaving(tmp_path):
    result = torchrun(["--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path)])
    assert "terminate called" not in result.stdout + result.stderr
    ranks = read_ranks(tmp_path, "teardown", 2)
    assert ranks[1]["done"] < ranks[0]["done"]  # rank 0 had more to do after fit
    assert ranks[1]["left"] >= ranks[0]["done"]  # rank 1 left the group only once rank 0 was done
