"""The shared-memory gradient average on several processes: exact where used, Gloo elsewhere,
agreed by every rank, nothing left behind, and a dead peer noticed within seconds."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from dist_helpers import assert_close_lists, child_env, read_ranks, torchrun

SHM_WORKER = pathlib.Path(__file__).resolve().parent / "shm_worker.py"
sys.path.insert(0, str(SHM_WORKER.parent))
import shm_worker  # noqa: E402


def _hapi_files() -> set[str]:
    shm = pathlib.Path("/dev/shm")
    return {p.name for p in shm.glob("hapi-*")} if shm.is_dir() else set()


@pytest.fixture(autouse=True)
def no_file_left_in_dev_shm():
    before = _hapi_files()  # other jobs' are not ours
    yield
    assert _hapi_files() <= before


def _run(scenario: str, out: pathlib.Path, nproc: int = 2, **env: str) -> list[dict]:
    torchrun(
        ["--standalone", f"--nproc_per_node={nproc}", str(SHM_WORKER), scenario, str(out)], **env
    )
    return read_ranks(out, scenario, nproc)


def test_three_processes_add_in_rank_order_and_agree_to_the_bit(tmp_path):
    ranks = _run("order", tmp_path, nproc=3)  # more processes than this machine's cores
    for call in range(shm_worker.ORDER_CALLS):
        values = [torch.tensor(shm_worker.order_values(r, call)) for r in range(3)]
        expected = ((values[0] + values[1]) + values[2]) / 3  # float32, in rank order
        assert (
            expected.numpy().tobytes()
            != (((values[2] + values[1]) + values[0]) / 3).numpy().tobytes()
        )
        for rank in ranks:
            assert rank["comm_hooks"] == ["average_hook"]
            assert rank["grads"][call] == expected.numpy().tobytes().hex()


def test_two_processes_fit_to_bitwise_equal_weights(tmp_path):
    ranks = _run("fit", tmp_path)
    assert ranks[0]["weights_hex"] == ranks[1]["weights_hex"]  # raw bytes, not allclose
    for rank in ranks:
        assert rank["comm_hooks"] == ["average_hook"] and rank["reasons"] == [None]
        # Rank 0 released its own descriptor; each process keeps its mapping (and the one
        # descriptor Python's mmap holds for it): no file, no name, no second copy.
        assert len(rank["memfd_descriptors"]) == 1 and rank["memfd_mappings"] == 1


def test_sparse_gradients_train_through_gloo_like_one_process(tmp_path):
    ranks = _run("sparse", tmp_path)
    model = shm_worker.sparse_model()
    model.fit(shm_worker.token_data(), batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = shm_worker.flat(model).tolist()
    for rank in ranks:
        assert rank["comm_hooks"] == []
        assert "embedding (Embedding) has sparse=True" in rank["reasons"][0]
        assert_close_lists(rank["weights"], expected)  # |dw| < 1e-5


def test_a_process_that_cannot_use_it_keeps_every_process_on_gloo(tmp_path):
    ranks = _run("disagree", tmp_path)
    x, y = shm_worker.make_tiny_data(shm_worker.TRAIN_SAMPLES)
    model = shm_worker.tiny_model()
    model.fit((x, y), batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = shm_worker.flat(model).tolist()
    for case, (where, _) in shm_worker.DISAGREEMENTS.items():
        assert ranks[0][case]["reason"] == ranks[1][case]["reason"]  # agreed, and it says who
        assert ranks[0][case]["reason"].startswith(
            "rank 0: " if where in (0, None) else "rank 1: "
        ), case
        for rank in ranks:
            assert rank[case]["comm_hooks"] == [], case
            assert_close_lists(rank[case]["weights"], expected)


def test_an_unexpected_error_on_one_rank_is_raised_on_every_rank(tmp_path):
    for rank in _run("attach_error", tmp_path):  # returns: nobody was left waiting
        assert rank["error"].startswith(
            "Setting up the shared-memory gradient average failed on rank 1: "
            "ValueError: injected on rank 1. Every process stops"
        )


def test_a_crash_right_after_reserving_leaves_nothing_behind(tmp_path):
    result = torchrun(
        [
            "--standalone",
            "--nproc_per_node=2",
            str(SHM_WORKER),
            "crash_after_reserve",
            str(tmp_path),
        ],
        check=False,
        timeout=120,
    )
    assert result.returncode != 0
    assert (tmp_path / "reserved").exists()  # rank 0 died holding the buffer
    # no_file_left_in_dev_shm checks /dev/shm; the buffer had no name anywhere else either.


def _survivor_stops(tmp_path: pathlib.Path, port: int, **env: str) -> tuple[float, int, str, str]:
    """Two processes started by hand (no launcher), training; rank 1 is SIGKILLed (and not
    reaped, as nobody watches it). Returns how long rank 0 took to exit, its exit code, its
    output, and the comm hooks it trained with."""
    logs = [open(tmp_path / f"output.rank{r}", "w") for r in range(2)]
    processes = [
        subprocess.Popen(
            [sys.executable, str(SHM_WORKER), "until_killed", str(tmp_path)],
            env=child_env(
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                HAPI_DIST_TIMEOUT="300",
                **env,
            ),
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for r in range(2)
    ]
    try:
        ready = [tmp_path / f"ready.rank{r}" for r in range(2)]
        deadline = time.monotonic() + 150
        while not all(path.exists() for path in ready):
            if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                outputs = [(tmp_path / f"output.rank{r}").read_text()[-3000:] for r in range(2)]
                raise AssertionError(f"the two processes did not start training: {outputs}")
            time.sleep(0.05)
        time.sleep(0.2)
        processes[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = processes[0].wait(timeout=120)
        elapsed = time.monotonic() - killed
        return elapsed, code, (tmp_path / "output.rank0").read_text(), ready[0].read_text()
    finally:
        for process, log in zip(processes, logs):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            log.close()


@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_a_killed_peer_stops_the_survivor_within_seconds_without_a_launcher(
    tmp_path, free_port, shared_memory
):
    elapsed, code, output, hooks = _survivor_stops(
        tmp_path, free_port, HAPI_SHM_ALLREDUCE=shared_memory
    )
    print(
        f"HAPI_SHM_ALLREDUCE={shared_memory}: the survivor exited {elapsed:.2f} s after its peer "
        "was killed"
    )
    assert code != 0
    assert elapsed < 20  # HAPI_DIST_TIMEOUT is 300 s
    if shared_memory == "1":
        assert hooks == '["average_hook"]'
        assert (
            "waiting for the gradients of rank 1 (process" in output
            and "no longer running" in output
        )
    else:
        assert hooks == "[]"
