"""Launchers that set their own variables, and the process group joined before the Model.

A script in pytorch/examples' order (hapi.distributed.init(), a DataLoader with a
DistributedSampler, then the Model) trains on 2 processes like one process at twice the
batch, under torchrun and in a Kubeflow-style environment (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK, no LOCAL_RANK). LSF's and MPI's variables become torch.distributed ones
(mpirun itself runs in test_mpi.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from dist_helpers import TORCH_VARIABLES, WORKER, assert_close_lists, child_env, torchrun
from torch.utils.data import DataLoader

from hapi import distributed
from hapi.distributed import env

SCRIPT = WORKER.parent / "launch_script.py"


def assert_trained_like_one_process(out, processes=2):
    """Each rank's weights and evaluate figures equal one process's at batch 8 * processes."""
    sys.path.insert(0, str(SCRIPT.parent))
    import launch_script  # noqa: PLC0415

    model, figures = launch_script.train(DataLoader(launch_script.DATA, batch_size=8 * processes))
    expected = [float(v) for p in model.parameters() for v in p.detach().flatten()]
    ranks = [json.loads((out / f"launch.rank{r}.json").read_text()) for r in range(processes)]
    for rank in ranks:
        assert_close_lists(rank["weights"], expected)
        assert rank["figures"] == pytest.approx(figures, abs=1e-6)
        assert rank["prepared_before_mine"]  # main_process_first: the main process went first
    return ranks


def test_torchrun_script_in_pytorch_examples_order(tmp_path):
    torchrun(["--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path)])
    ranks = assert_trained_like_one_process(tmp_path)
    assert [r["before_init"] for r in ranks] == [[0, 2], [1, 2]]


def test_kubeflow_style_environment_without_local_rank(tmp_path, free_port):
    processes = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path)],
            env=child_env(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port), WORLD_SIZE="2", RANK=str(r)
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    ranks = assert_trained_like_one_process(tmp_path)
    assert [(r["env"]["RANK"], r["env"]["LOCAL_RANK"]) for r in ranks] == [("0", "0"), ("1", "0")]


@pytest.fixture
def environ(monkeypatch):
    """A private os.environ without any launcher's variables (the translation writes it)."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for name in list(os.environ):
        if name in TORCH_VARIABLES or name.startswith(("SLURM_", "OMPI_", "PMI", "LSB_", "JSM_")):
            del os.environ[name]
    return os.environ


def _formed(environ, **launcher):
    environ.update(launcher)
    environ.update(env.launcher_variables())
    return {name: environ.get(name) for name in TORCH_VARIABLES}


def test_kubeflow_local_rank_from_the_processes_per_pod(environ):
    assert _formed(environ, WORLD_SIZE="8", RANK="5", LOCAL_WORLD_SIZE="4")["LOCAL_RANK"] == "1"


def test_lsf_variables_become_torch_distributed_ones(environ, tmp_path):
    rank_file = tmp_path / "rankfile"
    rank_file.write_text("launch1\n" + "gpu07\n" * 2 + "gpu08\n" * 2)
    formed = _formed(
        environ,
        LSB_JOBID="4321",
        LSB_DJOB_RANKFILE=str(rank_file),
        JSM_NAMESPACE_SIZE="4",
        JSM_NAMESPACE_RANK="3",
        JSM_NAMESPACE_LOCAL_RANK="1",
        OMPI_COMM_WORLD_RANK="3",  # jsrun sets Open MPI's too: LSF's name the first host
        OMPI_COMM_WORLD_SIZE="4",
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
    )
    assert formed == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",  # the first host after the launch node
        "MASTER_PORT": str(20000 + 4321),
    }
    assert distributed.rank() == 3 and distributed.world_size() == 4
    for name in (*TORCH_VARIABLES, "LSB_DJOB_RANKFILE"):
        del environ[name]
    environ["LSB_HOSTS"] = "launch1 gpu09 gpu09"
    assert env.launcher_variables()["MASTER_ADDR"] == "gpu09"
    del environ["JSM_NAMESPACE_LOCAL_RANK"]
    with pytest.raises(env.DistributedSetupError, match="JSM_NAMESPACE_LOCAL_RANK is not set, so"):
        env.launcher_variables()


@pytest.mark.parametrize(
    "launcher, said",
    [
        (
            {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "x", "SLURM_LOCALID": "0"},
            r"SLURM_PROCID='x' is not an integer",
        ),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "one"}, r"RANK='one' is not an"),
        (
            {
                "JSM_NAMESPACE_SIZE": "2",
                "JSM_NAMESPACE_RANK": "0",
                "LSB_DJOB_RANKFILE": "/nonexistent",
            },
            r"LSB_DJOB_RANKFILE='/nonexistent' cannot be read \(No such file",
        ),
    ],
    ids=["slurm-rank", "openmpi-rank", "lsf-rank-file"],
)
def test_a_launcher_variable_that_makes_no_sense_is_named(environ, launcher, said):
    environ.update(
        SLURM_JOB_ID="7", SLURM_STEP_NODELIST="node1", LSB_JOBID="7", JSM_NAMESPACE_LOCAL_RANK="0"
    )
    environ.update(launcher)
    with pytest.raises(env.DistributedSetupError, match=said):
        env.launcher_variables()


def test_mpich_and_intel_mpi_variables_on_one_machine(environ):
    formed = _formed(environ, PMI_RANK="2", PMI_SIZE="3", MPI_LOCALRANKID="2")
    assert formed == {
        "RANK": "2",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "3",
        "LOCAL_WORLD_SIZE": "3",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(20000 + os.getppid() % 40000),  # what the processes share: mpirun
    }


def test_mpi_on_several_machines_needs_the_address_passed(environ):
    environ.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="4")
    environ.update(OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    with pytest.raises(env.DistributedSetupError, match="mpirun -x MASTER_ADDR -x MASTER_PORT"):
        env.launcher_variables()
    environ.update(MASTER_ADDR="node1", MASTER_PORT="29400")
    assert env.launcher_variables()["MASTER_ADDR"] == "node1"


def test_torch_variables_win_then_slurm(environ):
    mpi = {"PMI_RANK": "1", "PMI_SIZE": "2"}
    slurm = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    slurm.update(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="n1")
    environ.update(mpi, **slurm)
    assert env.launcher_variables()["RANK"] == "0"  # srun's, not the MPI library's
    environ.update(WORLD_SIZE="4", RANK="3", LOCAL_RANK="1")
    assert not env.launcher_variables()  # torchrun's (under srun or mpirun) are kept as they are


def test_on_one_process_init_barrier_and_main_process_first_do_nothing_but_run(environ):
    distributed.init()
    distributed.init()
    assert not torch.distributed.is_initialized()
    distributed.barrier()
    ran = []
    with distributed.main_process_first():
        ran.append(True)
    assert ran == [True]


def test_a_failing_main_process_first_block_stops_the_others_at_once(tmp_path):
    """They waited for the main process until the timeout, then got Gloo's timeout error."""
    script = WORKER.parent / "first_fails_script.py"
    torchrun(
        ["--standalone", "--nproc_per_node=2", str(script), str(tmp_path)], HAPI_DIST_TIMEOUT="60"
    )
    main, other = (json.loads((tmp_path / f"first.rank{r}.json").read_text()) for r in (0, 1))
    assert main["seen"] == "OSError: download failed: no network"
    assert other["seen"].startswith("RuntimeError: The main process failed in its")
    assert other["seconds"] < 30  # not HAPI_DIST_TIMEOUT's 60 s


def test_mpirun_inside_a_slurm_allocation_takes_mpis_places(environ):
    """Open MPI's processes inherit its daemons' step (one task per node): Slurm's variables
    gave every node's processes one rank; with no step at all it warned 'not started by srun'."""
    environ.update(
        SLURM_NTASKS="8",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_PROCID="1",
        SLURM_LOCALID="0",
        SLURM_JOB_ID="77",
        SLURM_STEP_NODELIST="node[1-2]",
        SLURM_STEP_TASKS_PER_NODE="1(x2)",
        OMPI_COMM_WORLD_RANK="5",
        OMPI_COMM_WORLD_SIZE="8",
        OMPI_COMM_WORLD_LOCAL_RANK="1",
        OMPI_COMM_WORLD_LOCAL_SIZE="4",
        MASTER_ADDR="node1",
        MASTER_PORT="29500",
    )
    found = env.launcher_variables()
    assert (found["RANK"], found["WORLD_SIZE"], found["LOCAL_RANK"]) == ("5", "8", "1")
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_STEP_NODELIST"):
        del environ[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not started by srun" warning
        assert env.launcher_variables()["RANK"] == "5"
