"""Under srun, the same script forms one job from Slurm's variables (no torch.distributed ones)."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import warnings

import pytest
from dist_helpers import TORCH_VARIABLES, WORKER, assert_close_lists, child_env

from hapi.distributed import env

SCRIPT = WORKER.parent / "slurm_script.py"


def _srun_like(tmp_path, port, tasks=2):
    """What srun gives each of its tasks on one node; no RANK/WORLD_SIZE/MASTER_*."""
    processes = []
    for task in range(tasks):
        slurm = {
            "SLURM_JOB_ID": str(port - 20000),
            "SLURM_NTASKS": str(tasks),
            "SLURM_STEP_NUM_TASKS": str(tasks),
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(task),
            "SLURM_LOCALID": str(task),
            "SLURM_NODEID": "0",
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_STEP_TASKS_PER_NODE": str(tasks),
        }
        processes.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), str(tmp_path)],
                env=child_env(**slurm),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [0] * tasks, outputs
    return [json.loads((tmp_path / f"slurm.rank{task}.json").read_text()) for task in range(tasks)]


def _free_port_a_job_id_maps_to() -> int:
    """A free port in 20000-59999, the range MASTER_PORT = 20000 + job id mod 40000 covers
    (a port the system hands out may lie outside it)."""
    for candidate in random.Random().sample(range(20000, 60000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            return candidate
    raise RuntimeError("no free port in 20000-59999 on 127.0.0.1")


def test_srun_tasks_train_as_one_job(tmp_path):
    ranks = _srun_like(tmp_path, _free_port_a_job_id_maps_to())
    assert [(r["rank"], r["world_size"], r["local_world_size"]) for r in ranks] == [
        (0, 2, "2"),
        (1, 2, "2"),
    ]
    sys.path.insert(0, str(SCRIPT.parent))
    import slurm_script  # noqa: PLC0415

    one_process = slurm_script.train(16)  # 2 tasks at batch 8 train like one process at 16
    expected = [float(v) for p in one_process.parameters() for v in p.detach().flatten()]
    for rank in ranks:
        assert_close_lists(rank["weights"], expected)


@pytest.fixture(autouse=True)
def private_environment(monkeypatch):
    """a Model writes launcher_variables() into os.environ: each test gets a copy, so nothing leaks into later tests."""
    import os

    monkeypatch.setattr(os, "environ", dict(os.environ))


def test_slurm_variables_become_torch_distributed_ones(monkeypatch):
    for name in TORCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in {
        "SLURM_STEP_NUM_TASKS": "7",
        "SLURM_NTASKS": "7",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_NODELIST": "gpu[03-05,9],cpu1",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),3",
    }.items():
        monkeypatch.setenv(name, value)
    import os

    os.environ.update(env.launcher_variables())
    assert {name: os.environ[name] for name in TORCH_VARIABLES} == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "7",
        "LOCAL_WORLD_SIZE": "3",
        "MASTER_ADDR": "gpu03",
        "MASTER_PORT": str(20000 + 123456 % 40000),
    }


def test_torchrun_under_slurm_wins(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun sets it (Kubeflow does not)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    assert not env.launcher_variables()


def test_a_batch_script_without_srun_warns_and_trains_alone(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    with pytest.warns(
        UserWarning, match=r"SLURM_NTASKS=4 tasks, but the script was not started by srun"
    ):
        assert not env.launcher_variables()
    monkeypatch.setenv("SLURM_NTASKS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not env.launcher_variables()


def test_srun_without_a_place_is_explained(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    with pytest.raises(env.DistributedSetupError, match=r"srun started 2 tasks, but SLURM_PROCID"):
        env.launcher_variables()
