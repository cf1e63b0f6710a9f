"""The tests' warm torchrun launch behaves as the ``torchrun`` command: the same worker output,
the same exit status on success and on a failing rank, the launch's working directory and
environment, and a hung job killed with all its workers at the time limit."""

from __future__ import annotations

import os
import sys
import time

import pytest
import warm_launcher
from dist_helpers import child_env, run_bounded

SCRIPT = """
import os, sys, time
line = f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} {os.getcwd()} {os.environ['PROBE']}\\n"
os.write(1, line.encode())  # one write: the two ranks share the output
if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
    sys.exit(3)
if os.environ.get("HANG") == "1":
    open(f"pid.{os.environ['RANK']}", "w").write(str(os.getpid()))
    time.sleep(600)
"""


def _both(tmp_path, **env):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    args = ["--standalone", "--nproc_per_node=2", str(script)]
    launch_env = child_env(PROBE="here", **env)
    cold = run_bounded(
        [sys.executable, "-m", "torch.distributed.run", *args], 120, launch_env, cwd=tmp_path
    )
    warm = warm_launcher.server(child_env()).run(args, 120, launch_env, cwd=tmp_path)
    return cold, warm


def _rank_lines(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith("rank "))


@pytest.mark.parametrize("fail_rank", [None, "1"], ids=["success", "rank 1 exits 3"])
def test_warm_launch_matches_the_command(tmp_path, fail_rank):
    env = {"FAIL_RANK": fail_rank} if fail_rank else {}
    cold, (returncode, stdout, stderr, timed_out) = _both(tmp_path, **env)
    assert not timed_out
    assert returncode == cold.returncode == (1 if fail_rank else 0)
    assert _rank_lines(stdout) == _rank_lines(cold.stdout)
    assert _rank_lines(stdout) == [f"rank {r} of 2 {tmp_path} here" for r in range(2)]
    if fail_rank:
        assert "exitcode  : 3" in stderr and "exitcode  : 3" in cold.stderr


def test_a_hung_job_is_killed_with_its_workers_at_the_limit(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = child_env(PROBE="here", HANG="1")
    args = ["--standalone", "--nproc_per_node=2", str(script)]
    started = time.monotonic()
    _, _, _, timed_out = warm_launcher.server(child_env()).run(args, 6, env, cwd=tmp_path)
    assert timed_out and time.monotonic() - started < 60
    pids = [int((tmp_path / f"pid.{rank}").read_text()) for rank in range(2)]
    time.sleep(0.5)
    for pid in pids:
        assert (
            not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
        )
