"""``mpirun -np 2 python train.py`` trains like one process at twice the batch, script unchanged.

Runs Open MPI's mpirun for real (Debian's openmpi-bin); skipped where there is none.
"""

from __future__ import annotations

import shutil
import sys

import pytest
from dist_helpers import child_env, run_bounded
from test_launch_env import SCRIPT, assert_trained_like_one_process

pytestmark = pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="mpirun is not on PATH (Debian: apt install openmpi-bin)"
)


def test_mpirun_on_one_machine_with_nothing_else_set(tmp_path):
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
    result = run_bounded(
        [*command, sys.executable, str(SCRIPT), str(tmp_path)],
        180,
        child_env(),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = assert_trained_like_one_process(tmp_path)
    assert [r["before_init"] for r in ranks] == [[0, 2], [1, 2]]  # read from OMPI_COMM_WORLD_*
    formed = [r["env"] for r in ranks]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in formed] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in formed} == {
        ("127.0.0.1", formed[0]["MASTER_PORT"])  # one port, agreed without communicating
    }
