"""The shared-memory gradient average, seen from one process: the sum, the wait, the buffer.

Several "ranks" here are states in one process (or a child process) mapping
the same buffer; the test plays the others by writing their lines and rows.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from hapi.distributed import shared_memory
from hapi.distributed.ddp import _why_not
from hapi.distributed.shared_memory import (
    _COUNT,
    _PUBLISHED,
    SharedMemoryAllReduce,
    reason_not_to_use,
    release,
    reserve,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def process_identity() -> tuple[int, int]:
    """This process's (pid, start time), as ddp.py passes every rank's to the state."""
    mine = shared_memory.identity()
    return mine["pid"], mine["start"]


@pytest.fixture
def buffers():
    """Makes buffers; releases them and unmaps their states after the test."""
    worlds: dict = {}  # each buffer made, and its number of processes
    states: list = []

    def make(numel: int, world: int):
        reservation = reserve(numel, world)
        assert reservation is not None
        worlds[reservation] = world
        return reservation

    def attach(reservation, rank: int, timeout_s: float = 30.0, peers=None):
        # Every rank is this process unless told otherwise; a forged buffer is for 2.
        world = worlds.get(reservation, 2)
        state = SharedMemoryAllReduce(
            reservation, rank, peers or [process_identity()] * world, timeout_s
        )
        states.append(state)
        return state

    yield make, attach
    for state in states:
        state.close()
    for reservation in worlds:
        release(reservation)


def _publish_as(state: SharedMemoryAllReduce, rank: int, values: list[float]) -> None:
    """What rank ``rank`` does for ``state``'s next call: its row, its count, then the call number."""
    call = state.calls + 1
    state.rows[call % 2, rank, : len(values)] = torch.tensor(values)
    state.lines[rank, _COUNT + call % 2] = len(values)
    state.lines[rank, _PUBLISHED] = call


def test_the_average_is_over_every_rank_in_rank_order(buffers):
    make, attach = buffers
    state = attach(make(numel=4, world=3), rank=0)
    # float32: 1e8 + 1 rounds back to 1e8, so only rank order gives these sums.
    _publish_as(state, 1, [1.0, 1e8, -1e8, 6.0])
    _publish_as(state, 2, [-1e8, -1e8, 1.0, 9.0])
    gradients = torch.tensor([1e8, 1.0, 1e8, 3.0])
    assert state.average(gradients) is gradients  # averaged in place, as DDP's bucket expects
    expected = (
        torch.tensor([1e8, 1.0, 1e8, 3.0])
        + torch.tensor([1.0, 1e8, -1e8, 6.0])
        + torch.tensor([-1e8, -1e8, 1.0, 9.0])
    ) / 3
    assert gradients.numpy().tobytes() == expected.numpy().tobytes()
    assert gradients.tolist()[:2] == [0.0, 0.0] and gradients[3] == 6.0
    assert state.lines[0, _PUBLISHED] == 1  # rank 0 published its call
    # The next call uses the other half; a shorter bucket reads only its own elements.
    _publish_as(state, 1, [2.0, 4.0])
    _publish_as(state, 2, [3.0, 5.0])
    assert state.average(torch.tensor([1.0, 3.0])).tolist() == [2.0, 4.0]


def test_each_process_writes_its_own_cache_lines_whatever_the_size(buffers):
    make, attach = buffers
    for numel in (1, 3, 7):  # odd sizes put the old counters off their lines
        state = attach(make(numel=numel, world=3), rank=1)
        assert state.lines.ctypes.data % 64 == 0  # the counters start on a line...
        assert state.lines.strides == (64, 8)  # ...and each process has a line of its own
        assert state.rows.data_ptr() % 64 == 0
        assert (
            state.rows.data_ptr() >= state.lines.ctypes.data + 3 * 64
        )  # no row shares a counter's line


def test_buckets_of_different_sizes_raise_on_both_ranks(buffers):
    make, attach = buffers
    reservation = make(numel=4, world=2)
    states = [attach(reservation, rank) for rank in (0, 1)]
    errors: dict[int, BaseException] = {}

    def run(rank: int, size: int) -> None:
        try:
            states[rank].average(torch.ones(size))
        except RuntimeError as error:
            errors[rank] = error

    threads = [threading.Thread(target=run, args=(0, 4)), threading.Thread(target=run, args=(1, 3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(errors) == [0, 1]  # neither averaged stale memory
    assert "Rank 0 averages a gradient bucket of 4 elements, but rank 1 published 3" in str(
        errors[0]
    )
    assert "Rank 1 averages a gradient bucket of 3 elements, but rank 0 published 4" in str(
        errors[1]
    )
    assert "same trainable parameters" in str(errors[0]) and "HAPI_SHM_ALLREDUCE=0" in str(
        errors[0]
    )


def test_a_rank_that_never_arrives_is_named_after_the_timeout(buffers):
    make, attach = buffers
    state = attach(make(numel=4, world=2), rank=0, timeout_s=0.2)  # rank 1 is this live process
    with pytest.raises(RuntimeError, match=r"gradients of rank\(s\) \[1\].*HAPI_DIST_TIMEOUT"):
        state.average(torch.ones(4))


_CHILD = """
import pickle, sys, time
from hapi.distributed.shared_memory import SharedMemoryAllReduce, identity
reservation, parent = pickle.loads(bytes.fromhex(sys.argv[1]))
me = identity()
state = SharedMemoryAllReduce(reservation, 1, [parent, (me["pid"], me["start"])], 300.0)
print("mapped", flush=True)
time.sleep(600)
"""


def test_a_dead_peer_is_noticed_within_seconds_not_after_the_timeout(buffers):
    make, attach = buffers
    reservation = make(numel=4, world=2)
    argument = pickle.dumps((reservation, process_identity())).hex()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, argument],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert child.stdout.readline().strip() == "mapped"
        state = attach(
            reservation,
            0,
            timeout_s=300.0,  # HAPI_DIST_TIMEOUT's default
            peers=[process_identity(), (child.pid, shared_memory._start_time(child.pid))],
        )
        killer = threading.Timer(0.3, os.kill, (child.pid, signal.SIGKILL))  # not reaped: a zombie
        killer.start()
        started = time.monotonic()
        with pytest.raises(
            RuntimeError,
            match=rf"gradients of rank 1 \(process {child.pid}\), which is "
            "no longer running",
        ):
            state.average(torch.ones(4))
        assert time.monotonic() - started < 5
        killer.join()
    finally:
        child.kill()
        child.wait()


def test_only_rank_0s_buffer_is_accepted(buffers):
    make, attach = buffers
    reservation = make(numel=4, world=2)
    other = make(numel=4, world=2)
    forged = shared_memory.Reservation(
        reservation.fd, reservation.name, other.token, 4
    )  # the right memory, another token
    with pytest.raises(OSError, match="does not hold rank 0's token"):
        attach(forged, 1)
    elsewhere = shared_memory.Reservation(
        other.fd, reservation.name, reservation.token, 4
    )  # that descriptor is another buffer
    with pytest.raises(OSError, match="not rank 0's buffer"):
        attach(elsewhere, 1)
    with pytest.raises(OSError, match="holds .* bytes, not the buffer's"):
        attach(
            shared_memory.Reservation(reservation.fd, reservation.name, reservation.token, 5),
            1,
        )
    with pytest.raises(
        OSError, match="rank 1's process .* is not visible"
    ):  # another pid namespace
        attach(reservation, 0, peers=[process_identity(), (os.getpid(), 1)])


def test_every_process_must_see_every_other_ones_writes(buffers):
    make, attach = buffers
    reservation = make(numel=4, world=2)
    theirs = os.getppid()  # a live process that is not rank 1 yet
    rank_0 = attach(
        reservation, 0, peers=[process_identity(), (theirs, shared_memory._start_time(theirs))]
    )
    assert not rank_0.everyone_attached()  # rank 1 has not written its id yet
    rank_0.lines[1, shared_memory._PID] = theirs  # as rank 1 does when it maps the buffer
    assert rank_0.everyone_attached()


def test_the_buffer_has_no_name_and_its_descriptor_is_released():
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    descriptors = len(os.listdir("/proc/self/fd"))
    reservation = reserve(numel=4, world=2)
    assert reservation is not None
    assert (
        os.readlink(f"/proc/{os.getpid()}/fd/{reservation.fd}")
        == f"/memfd:{reservation.name} (deleted)"
    )
    assert (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) == before
    release(reservation)
    assert len(os.listdir("/proc/self/fd")) == descriptors


def test_no_room_for_the_buffer_gives_none_and_leaks_nothing(monkeypatch):
    descriptors = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(
        os, "posix_fallocate", lambda *args: (_ for _ in ()).throw(OSError(28, "full"))
    )
    assert reserve(numel=4, world=2) is None
    assert len(os.listdir("/proc/self/fd")) == descriptors


def test_a_sparse_bucket_raises_instead_of_a_reshape_error(buffers):
    make, attach = buffers
    state = attach(make(numel=4, world=1), rank=0)
    with pytest.raises(
        RuntimeError, match="sparse_coo torch.float32 gradient bucket.*HAPI_SHM_ALLREDUCE=0"
    ):
        state.average(torch.ones(4).to_sparse())


class _Embedded(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.tokens = module
        self.out = nn.Linear(4, 2)


@pytest.mark.parametrize(
    "module", [nn.Embedding(5, 4, sparse=True), nn.EmbeddingBag(5, 4, sparse=True)]
)
def test_sparse_gradients_keep_gloo(module):
    network = _Embedded(module)
    reason = reason_not_to_use(network, list(network.parameters()))
    assert reason is not None and f"tokens ({type(module).__name__}) has sparse=True" in reason
    module.weight.requires_grad_(False)  # a frozen sparse embedding yields no gradient at all
    assert reason_not_to_use(network, [p for p in network.parameters() if p.requires_grad]) is None
    assert reason_not_to_use(_Embedded(nn.Embedding(5, 4)), []) is None


def test_only_linux_on_x86_64_with_the_needed_calls(monkeypatch):
    network = nn.Linear(2, 2)
    parameters = list(network.parameters())
    assert reason_not_to_use(network, parameters) is None
    monkeypatch.setattr("platform.machine", lambda: "arm64")
    assert "the platform is linux on arm64" in reason_not_to_use(network, parameters)
    monkeypatch.undo()
    for name in ("posix_fallocate", "sched_yield", "memfd_create"):
        with monkeypatch.context() as patch:
            patch.delattr(os, name)
            assert reason_not_to_use(network, parameters) == f"this Python's os module lacks {name}"
    monkeypatch.setenv("HAPI_SHM_ALLREDUCE", "0")
    assert reason_not_to_use(network, parameters) == "HAPI_SHM_ALLREDUCE=0"
    monkeypatch.delenv("HAPI_SHM_ALLREDUCE")
    assert "torch.float64 on cpu" in reason_not_to_use(network, list(network.double().parameters()))


def _facts(host="box", boot_id="b1", reason=None, numel=10):
    return {
        "reason": reason,
        "host": host,
        "boot_id": boot_id,
        "pid": 1,
        "start": 1,
        "numel": numel,
    }


def test_one_machine_means_one_hostname_and_one_boot_and_every_rank_agrees():
    assert _why_not([_facts(), _facts()]) is None
    assert "not all on one machine" in _why_not(
        [_facts(), _facts(boot_id="b2")]
    )  # same name, another kernel
    assert "not all on one machine" in _why_not([_facts(), _facts(host="other")])
    assert "not all on one machine" in _why_not(
        [_facts(boot_id=""), _facts(boot_id="")]
    )  # unprovable
    assert (
        _why_not([_facts(), _facts(reason="HAPI_SHM_ALLREDUCE=0")])
        == "rank 1: HAPI_SHM_ALLREDUCE=0"
    )
    assert "different numbers of elements: [10, 11]" in _why_not([_facts(), _facts(numel=11)])
