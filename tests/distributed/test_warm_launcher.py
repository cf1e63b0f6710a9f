"""The tests' warm launches behave as the commands: ``torchrun`` (its agent and workers
forked) gives the same worker output, the same exit status on success and on a failing
rank, the launch's working directory and environment, and a hung job is killed with all
its workers at the time limit; ``python script`` (forked) gives the same output, paths,
exit status, traceback, thread joins and ``atexit`` handlers, and fresh random draws."""

from __future__ import annotations

import os
import sys
import time

import pytest
import warm_launcher
from dist_helpers import child_env, run_bounded, run_python

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


PLAIN = """
import atexit, os, random, sys, threading, time
import numpy, torch
print(sys.argv, sys.path[0], os.getcwd(), os.environ["PROBE"], torch.get_num_threads())
print("draws", random.random(), numpy.random.random(), file=sys.stderr)
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined"))).start()
if os.environ.get("FAIL") == "raise":
    raise ValueError("boom")
if os.environ.get("FAIL") == "exit":
    sys.exit(3)
"""


@pytest.mark.parametrize("fail", [None, "raise", "exit"])
def test_a_warm_script_run_matches_the_command(tmp_path, fail):
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    env = child_env(PROBE="here", **({"FAIL": fail} if fail else {}))
    argv = [str(script), "an argument"]
    cold = run_bounded([sys.executable, *argv], 120, env, cwd=tmp_path)
    warm = run_python(argv, 120, env, cwd=tmp_path)
    again = run_python(argv, 120, env, cwd=tmp_path)
    assert warm.returncode == cold.returncode == {None: 0, "raise": 1, "exit": 3}[fail]
    assert warm.stdout == cold.stdout
    assert cold.stdout.splitlines() == [
        f"{[str(script), 'an argument']} {tmp_path} {tmp_path} here 1",
        "thread joined",
        "atexit ran",
    ]
    if fail == "raise":
        for run in (cold, warm):
            assert run.stderr.strip().splitlines()[-1] == "ValueError: boom"
            assert f'File "{script}", line 9, in <module>' in run.stderr
    draws = [run.stderr.split("draws ")[1].split()[:2] for run in (warm, again)]
    assert draws[0][0] != draws[1][0] and draws[0][1] != draws[1][1]  # drawn anew, as a fresh start
