"""hapi.spawn: the seeds' spawn usages, per-rank logs, and a failing child."""

from __future__ import annotations

import json
import os
import pathlib
import re
import time

import pytest
import torch
from dist_helpers import WORKER, child_env, run_python

from hapi.launch import _visible_devices, resolve_nprocs, spawn

SCRIPT = WORKER.parent / "spawn_script.py"


def test_seed_usages_fn_only_args_nprocs_and_log_dir(tmp_path):
    env = child_env()
    del env["OMP_NUM_THREADS"]  # spawn shares the cores out itself
    result = run_python([str(SCRIPT), "usages", str(tmp_path)], 180, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for tag in ("plain", "nprocs"):  # spawn(train): one process per CPU core (2 here); nprocs=2
        records = [json.loads((tmp_path / f"{tag}.rank{r}.json").read_text()) for r in (0, 1)]
        assert [(r["rank"], r["world_size"]) for r in records] == [(0, 2), (1, 2)]
        assert records[0]["loss"] == records[1]["loss"]  # reduced across the two processes
        # two processes never each take every core
        assert [r["threads"] for r in records] == [max(1, (os.cpu_count() or 1) // 2)] * 2
    returned = json.loads((tmp_path / "returned.json").read_text())
    assert set(returned) == {"0", "1"}  # spawn returns {rank: fn's return value}
    for rank in (0, 1):  # like `launch --log_dir`: one log per rank
        assert f"rank {rank} says hello" in (tmp_path / "logs" / f"workerlog.{rank}").read_text()


def test_a_failing_child_makes_spawn_raise_its_error_promptly(tmp_path):
    started = time.monotonic()
    result = run_python([str(SCRIPT), "fail", str(tmp_path)], 120, child_env())
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert (
        "SpawnedProcessError: Process 1 of 2 started by hapi.spawn raised an error" in result.stderr
    )
    assert "ValueError: boom in a spawned child" in result.stderr
    assert elapsed < 60  # rank 0 was waiting for rank 1 in a collective: stopped, not hung


def test_children_that_die_get_their_cause_and_existing_log_files_named(tmp_path):
    env = child_env(SPAWN_SCRIPT_UNGUARDED=str(tmp_path / "unguarded"))
    (tmp_path / "hidden").mkdir()  # a log_dir used before: its old output is not this run's
    (tmp_path / "hidden" / "workerlog.0").write_text("an earlier run's output\n")
    result = run_python([str(SCRIPT), "dies", str(tmp_path)], 180, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    messages = json.loads((tmp_path / "messages.json").read_text())
    # No __main__ guard: every child died importing the script, before any output was redirected.
    assert messages["unguarded"].startswith(
        "hapi.spawn could not start its 2 processes: the script calls hapi.spawn when it is "
        "imported"
    ), messages["unguarded"]
    assert 'Put the call under `if __name__ == "__main__":`.' in messages["unguarded"]
    assert "workerlog" not in messages["unguarded"]
    assert not os.listdir(tmp_path / "unguarded")  # not even the launcher's empty directories
    # A child that exits without an exception: its output is in the file named, which exists.
    assert re.match(
        r"Process 1 of 2 started by hapi.spawn died with exit code 3 before it could report an "
        r"error; its output is in (\S+/workerlog\.1)\.",
        messages["exit"],
    ), messages["exit"]
    # fn defined under the guard: no child finds it, and none wrote to log_dir.
    hidden = tmp_path / "hidden"
    assert f"No process wrote anything to {hidden}" in messages["hidden"], messages["hidden"]
    assert '"Can\'t get attribute", define fn at the top level' in messages["hidden"]
    for named in re.findall(r"\S+/workerlog\.\d", messages["exit"]):
        assert "prints before it dies" in pathlib.Path(named).read_text(), named


def test_nprocs_and_gpus_follow_paddle():
    assert _visible_devices("4,5") == "4,5"
    assert _visible_devices([4, 5]) == "4,5"
    assert resolve_nprocs(-1, "4,5") == 2  # one process per selected GPU
    assert resolve_nprocs(3, None) == 3
    with pytest.raises(ValueError, match="gpus must list device numbers"):
        _visible_devices("first,second")
    with pytest.raises(ValueError, match="nprocs must be a positive integer or -1"):
        resolve_nprocs(0, None)


def test_gpus_on_a_machine_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine
    with pytest.raises(RuntimeError, match=r"gpus='4,5'.*torch.cuda.is_available\(\) is False"):
        spawn(print, gpus="4,5")
