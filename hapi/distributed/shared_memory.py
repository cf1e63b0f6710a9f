"""Gradient averaging through shared memory, for CPU processes on one machine.

Why: on a CPU machine every process trains on its own cores, and DDP's
Gloo all-reduce goes through TCP on the loopback. Measured on the project's
2-core machine, one all-reduce of LeNet's 244 KB of gradients took about 2 ms
(0.4 ms for 4 bytes): 12% of a step, paid every step. Processes on one
machine can instead write their gradients into one shared buffer and add them
up there, which costs a copy and a sum.

How: a DDP communication hook (DDP's own extension point). Each process
owns one row of a shared ``[2, world, n]`` buffer; per gradient bucket it
copies its gradients into its row, publishes the bucket's element count and a
sequence number, waits until every process has published the same number,
checks that every count equals its own (a process whose buckets differ would
otherwise be averaged with stale memory: it raises instead), and adds the
rows up one after the other in rank order, then divides -- the same sum in the
same order on every process, so the weights stay bitwise identical everywhere.
The two halves of the buffer alternate between calls: a process can only write
a half again two calls later, after every process has published the call in
between, i.e. finished reading it. The protocol relies on x86's store
ordering (a published number is seen only after the data written before it),
so it is used on Linux on x86-64 only.

The buffer: rank 0 makes it with ``memfd_create``, an anonymous file that has
no name in any directory, so nothing can outlive the processes, even after a
crash; the others open it through ``/proc/<rank 0's pid>/fd/<fd>`` while rank
0 still holds it, and rank 0 closes its descriptor once every process has
mapped it. Its pages are reserved when it is made (``posix_fallocate``): where
there is no memory for them, every process keeps Gloo's all-reduce rather than
being killed by SIGBUS at its first gradient. Each process checks that it
mapped the very buffer rank 0 made (its name, its size, and a random token
rank 0 wrote in it), writes its process id into its own line, and then checks
that it sees every other process's id there: they share the memory, not just
a name. Layout: one 64-byte header line (the token), one 64-byte line per
process (published call, pid, element count per half: no two processes ever
write the same cache line), then the rows, all 64-byte aligned.

A process waiting for the others spins briefly, then yields its core (more
processes than cores), and every half second of that it checks that the
processes it waits for still run (their ids and start times, exchanged at
setup), so when a rank dies -- even with no launcher watching -- the others
raise within about a second, with an error naming it, instead of waiting out
the distributed timeout. A rank that is alive but never arrives is given up
after that timeout.

Sparse gradients (``nn.Embedding(sparse=True)``) cannot be added row by row:
:func:`reason_not_to_use` keeps Gloo for such networks, and the hook raises if
it ever gets one.

:func:`hapi.distributed.ddp.wrap` decides and installs it; every collective
step of that decision (every rank's verdict from :func:`reason_not_to_use`,
its machine's hostname and boot id, its process id; rank 0's reservation;
every process's mapping) is in :mod:`hapi.distributed.ddp`, so all processes
agree. This module itself never talks to the other processes except through
the buffer; ``HAPI_SHM_ALLREDUCE=0`` keeps Gloo's all-reduce.
"""

from __future__ import annotations

import mmap
import os
import pathlib
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

_SPINS_BEFORE_YIELD = 2000
_PEER_CHECK_S = 0.5  # how often a process that yields checks that the ones it waits for still run
_LINE = 64  # bytes of a cache line: one for the header, one per process
_TOKEN_BYTES = 32
# Fields (int64) of a process's line.
_PUBLISHED, _PID, _COUNT = 0, 1, 2  # _COUNT + call % 2: the element count of that call's bucket


def reason_not_to_use(network: nn.Module, parameters: list[nn.Parameter]) -> str | None:
    """Why this process cannot average these gradients through shared memory (``None``: it can).

    Only this process's side; the process group's side -- Gloo, every process
    on one machine, all of them agreeing -- is :mod:`hapi.distributed.ddp`'s.
    """
    machine = platform.machine()
    missing = [n for n in ("memfd_create", "posix_fallocate", "sched_yield") if not hasattr(os, n)]
    others = sorted({f"{p.dtype} on {p.device}" for p in parameters} - {"torch.float32 on cpu"})
    sparse = [
        f"{name or 'the network'} ({type(module).__name__})"
        for name, module in network.named_modules()
        if getattr(module, "sparse", False) is True
        and any(p.requires_grad for p in module.parameters(recurse=False))
    ]
    linux_x86 = sys.platform.startswith("linux") and machine.lower() in ("x86_64", "amd64")
    reasons = [  # (whether it applies, the reason); the first that applies is the answer
        (os.environ.get("HAPI_SHM_ALLREDUCE", "1") == "0", "HAPI_SHM_ALLREDUCE=0"),
        (not linux_x86, f"the platform is {sys.platform} on {machine}, not Linux on x86-64"),
        (missing, f"this Python's os module lacks {', '.join(missing)}"),
        (others, f"parameters are {', '.join(others)}; the buffer holds float32 CPU gradients"),
        (sparse, f"{', '.join(sparse)} has sparse=True (Gloo adds sparse gradients, rows cannot)"),
    ]
    return next((reason for applies, reason in reasons if applies), None)


def identity() -> dict[str, Any]:
    """This process's id and start time (in clock ticks since boot; -1 where unknown), which
    together name it even after the id is reused, and its machine's hostname and boot id
    (``""`` where it cannot be read): processes that report the same pair run under one kernel."""
    boot = pathlib.Path("/proc/sys/kernel/random/boot_id")
    boot_id = boot.read_text().strip() if boot.exists() else ""
    start = _start_time(os.getpid()) or -1
    return {"host": platform.node(), "boot_id": boot_id, "pid": os.getpid(), "start": start}


@dataclass(frozen=True)
class Reservation:
    """Rank 0's buffer, as every process needs to know it to map it (sent to them by pickle).

    Rank 0's process id and the number of processes are not in it: the
    mapping reads them from ``peers`` (rank 0's first).
    """

    fd: int
    name: str
    token: bytes
    numel: int


def reserve(numel: int, world: int) -> Reservation | None:
    """A new anonymous buffer for ``world`` processes' ``numel`` gradients, its pages reserved.

    ``None`` where the memory cannot be had (``posix_fallocate`` fails here,
    instead of a process being killed by SIGBUS when it first writes a
    gradient). The caller closes the descriptor with :func:`release` once
    every process has mapped it. (A token short of its bytes is caught where
    it is checked, by every process that maps the buffer.)
    """
    token = os.urandom(_TOKEN_BYTES)  # random, as secrets.token_bytes
    name = f"hapi-allreduce-{token[:8].hex()}"
    descriptor = None
    try:
        descriptor = os.memfd_create(name, os.MFD_CLOEXEC)
        os.posix_fallocate(descriptor, 0, _size(numel, world))
        os.pwrite(descriptor, token, 0)
    except OSError:
        if descriptor is not None:
            os.close(descriptor)
        return None
    return Reservation(descriptor, name, token, numel)


def release(reservation: Reservation) -> None:
    """Rank 0 closes its descriptor: the memory lives on in the mappings, and goes with the last."""
    os.close(reservation.fd)


class SharedMemoryAllReduce:
    """The state of the hook: the mapped buffer, this process's row, the call count.

    Maps rank 0's buffer through ``/proc/<its pid>/fd/<its fd>``, after checking that
    it is that buffer: a memfd of that name (not whatever that descriptor
    number means in some other process), of that size, holding rank 0's
    token. Writes this process's id into its line. ``peers`` is every rank's
    ``(pid, start)`` from :func:`identity`; each must be visible here (the
    same machine and process namespace). Raises ``OSError`` where any of this
    fails: the processes then keep Gloo's all-reduce.
    """

    def __init__(
        self, reservation: Reservation, rank: int, peers: list[tuple[int, int]], timeout_s: float
    ) -> None:
        self.world, self.rank, self.timeout_s = len(peers), rank, timeout_s
        self.numel, self.peers, self.calls = reservation.numel, list(peers), 0
        for other, (pid, start) in enumerate(self.peers):
            if _start_time(pid) != start:
                raise OSError(
                    f"rank {other}'s process {pid} (started at tick {start}) is not visible "
                    "in this process's /proc: another machine, container or process namespace"
                )
        # Where a process of this machine opens rank 0's buffer while rank 0 holds it.
        path = f"/proc/{self.peers[0][0]}/fd/{reservation.fd}"
        size = _size(self.numel, self.world)
        target = os.readlink(path)
        if target != f"/memfd:{reservation.name} (deleted)":
            raise OSError(f"{path} is {target!r}, not rank 0's buffer {reservation.name}")
        with open(path, "r+b") as file:
            actual = os.fstat(file.fileno()).st_size
            if actual != size:
                raise OSError(f"{path} holds {actual} bytes, not the buffer's {size}")
            if file.read(_TOKEN_BYTES) != reservation.token:
                raise OSError(f"{path} does not hold rank 0's token: not the same memory")
            self._mapping = mmap.mmap(file.fileno(), size)
        self.lines = np.ndarray((self.world, _LINE // 8), np.int64, self._mapping, offset=_LINE)
        rows = torch.frombuffer(self._mapping, dtype=torch.float32, offset=_LINE * (1 + self.world))
        self.rows = rows.view(2, self.world, self.numel)  # the rest of the buffer, to its end
        self.lines[rank, _PID] = os.getpid()

    def everyone_attached(self) -> bool:
        """Whether this process sees every process's id in its line: once all have mapped the
        buffer (each checked rank 0's token in it), proof that they share one memory."""
        return self.lines[:, _PID].tolist() == [pid for pid, _ in self.peers]

    def close(self) -> None:
        """Unmap the buffer (the state is unusable afterwards)."""
        del self.rows, self.lines
        self._mapping.close()

    def average(self, gradients: torch.Tensor) -> torch.Tensor:
        """``gradients`` replaced, in place, by their mean over the processes."""
        if gradients.layout != torch.strided or gradients.dtype != torch.float32:
            raise RuntimeError(
                f"The shared-memory gradient average got a {gradients.layout} {gradients.dtype} "
                "gradient bucket; it adds dense float32 rows only and cannot hand it to Gloo "
                "mid-run. Set HAPI_SHM_ALLREDUCE=0 to use Gloo's all-reduce for every gradient."
            )
        count = gradients.numel()
        if count > self.numel:
            raise RuntimeError(
                f"A gradient bucket of {count} elements exceeds the shared buffer's {self.numel}: "
                "build the Model again after unfreezing parameters, or set HAPI_SHM_ALLREDUCE=0."
            )
        self.calls += 1
        half = self.calls % 2
        rows = self.rows[half, :, :count]
        rows[self.rank].copy_(gradients.reshape(-1))
        self.lines[self.rank, _COUNT + half] = count
        # Last: whoever sees the call published sees the row and the count.
        self.lines[self.rank, _PUBLISHED] = self.calls
        self._wait_for_everyone()
        counts = self.lines[:, _COUNT + half].tolist()
        other = next((r for r, theirs in enumerate(counts) if theirs != count), None)
        if other is not None:
            raise RuntimeError(
                f"Rank {self.rank} averages a gradient bucket of {count} elements, but rank {other} "
                f"published {counts[other]} (every rank's: {counts}). Every process must train the "
                "same network with the same trainable parameters, or set HAPI_SHM_ALLREDUCE=0."
            )
        flat = gradients.view(-1).copy_(rows[0])
        for other in range(1, self.world):  # one after the other, in rank order, on every process
            flat.add_(rows[other])
        flat.div_(self.world)
        return gradients

    def _wait_for_everyone(self) -> None:
        spins, published, calls, now = 0, self.lines[:, _PUBLISHED], self.calls, time.monotonic()
        deadline, next_check = now + self.timeout_s, now + _PEER_CHECK_S
        while (published < calls).any():
            spins += 1
            if spins < _SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()  # more processes than cores: let the one we wait for run
            now = time.monotonic()
            if now < next_check:
                continue
            next_check = now + _PEER_CHECK_S
            for other, (pid, start) in enumerate(self.peers):
                if published[other] < calls and _start_time(pid) != start:
                    raise RuntimeError(
                        f"Rank {self.rank} was waiting for the gradients of rank {other} (process "
                        f"{pid}), which is no longer running (see its output); restart the job."
                    )
            if now > deadline:
                missing = [r for r in range(self.world) if published[r] < calls]
                raise RuntimeError(
                    f"Rank {self.rank} waited {self.timeout_s:.0f} s for the gradients of rank(s) "
                    f"{missing}, which never arrived: those processes run but stopped or hang "
                    "elsewhere. Check their output; HAPI_DIST_TIMEOUT sets this limit."
                )


def average_hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP communication hook: one bucket of gradients (a ``dist.GradBucket``), averaged
    through the :class:`SharedMemoryAllReduce` in ``state``; returns a completed future."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(state.average(bucket.buffer()))
    return future


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or ``None`` where it is gone,
    a zombie, or not visible. One open and read of ``/proc/<pid>/stat``."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_bytes()
        fields = stat[stat.rindex(b")") + 2 :].split()  # the command name may hold spaces and ')'
        state, start = fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):  # gone, or an exiting process's file read back empty
        return None
    return None if state in (b"Z", b"X", b"x") else start  # Z, X: exited, not yet reaped


def _size(numel: int, world: int) -> int:
    """Bytes of the buffer: a header line and one line per process, then two halves of one
    float32 row per process."""
    return _LINE * (1 + world) + 2 * world * numel * 4
