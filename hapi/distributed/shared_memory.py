"""Gradient averaging through shared memory, for CPU processes on one machine.

Why: on a CPU machine every process trains on its own cores, and DDP's
Gloo all-reduce goes through TCP on the loopback. Measured on the project's
2-core machine, one all-reduce of LeNet's 244 KB of gradients took about 2 ms
(0.4 ms for 4 bytes): 12% of a step, paid every step. Processes on one
machine can instead write their gradients into one shared buffer and add them
up there, which costs a copy and a sum.

How: a DDP communication hook (DDP's own extension point). Each process
owns one row of a shared ``[2, world, n]`` buffer; per gradient bucket it
copies its gradients into its row, publishes a sequence number, waits until
every process has published the same number, and averages the rows in rank
order -- the same sum in the same order on every process, so the weights stay
identical everywhere. The two halves of the buffer alternate between calls:
a process can only write a half again two calls later, after every process
has published the call in between, i.e. finished reading it. The protocol
relies on x86's store ordering (a published number is seen only after the
data written before it), so it is used on x86-64 only.

The buffer's pages are reserved when it is made; where the RAM disk is too
small for them, every process keeps Gloo's all-reduce.

A process waiting for the others spins briefly, then yields its core, and
gives up after the distributed timeout with an error naming the ranks that
never arrived (a rank that died is normally stopped sooner by the launcher).

:func:`hapi.distributed.ddp.wrap` installs it (and does the collective part:
rank 0 reserves the file, every process maps it, all agree) when every
process is on this machine, the backend is Gloo, and every parameter is
float32 on the CPU; ``HAPI_SHM_ALLREDUCE=0`` keeps Gloo's all-reduce. This
module itself never talks to the other processes except through the buffer.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import tempfile
import time
import uuid

import numpy as np
import torch

_SPINS_BEFORE_YIELD = 2000


def usable_for(parameters: list[torch.nn.Parameter]) -> bool:
    """Whether the hook can average these parameters' gradients on this machine
    (the process group's side -- Gloo, all processes on this machine -- is
    :mod:`hapi.distributed`'s to check)."""
    return (os.environ.get("HAPI_SHM_ALLREDUCE", "1") != "0"
            and platform.machine().lower() in ("x86_64", "amd64")
            and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in parameters))


def reserve(numel: int, world: int) -> str | None:
    """A new shared file for ``world`` processes' ``numel`` gradients, its pages reserved.

    ``posix_fallocate`` makes a RAM disk that is too small (Docker gives
    containers 64 MB of ``/dev/shm``) fail here, with ``None``, instead of a
    process being killed by SIGBUS when it first writes a gradient.
    """
    path = os.path.join(_shm_dir(), f"hapi-allreduce-{uuid.uuid4().hex}")
    try:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(descriptor, 0, _size(numel, world))
        finally:
            os.close(descriptor)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    return path


class SharedMemoryAllReduce:
    """The state of the hook: the mapped buffer, this process's row, the call count.

    Every process maps the file :func:`reserve` made (``OSError`` where it
    cannot, e.g. on another machine); once all have, the file can be unlinked.
    """

    def __init__(self, path: str, numel: int, rank: int, world: int, timeout_s: float) -> None:
        self.world, self.rank, self.timeout_s = world, rank, timeout_s
        descriptor = os.open(path, os.O_RDWR)
        try:
            self._mapping = mmap.mmap(descriptor, _size(numel, world))
        finally:
            os.close(descriptor)
        self.rows = torch.from_numpy(np.ndarray((2, world, numel), np.float32, buffer=self._mapping))
        self.published = np.ndarray((world, 8), np.int64, buffer=self._mapping,
                                    offset=_rows_bytes(numel, world))
        self.calls = 0

    def average(self, gradients: torch.Tensor) -> torch.Tensor:
        """``gradients`` replaced, in place, by their mean over the processes."""
        self.calls += 1
        count = gradients.numel()
        rows = self.rows[self.calls % 2]
        rows[self.rank, :count].copy_(gradients.reshape(-1))
        self.published[self.rank, 0] = self.calls
        self._wait_for_everyone()
        torch.sum(rows[:, :count], dim=0, out=gradients.view(-1)).div_(self.world)
        return gradients

    def _wait_for_everyone(self) -> None:
        spins, deadline = 0, None
        while (self.published[:, 0] < self.calls).any():
            spins += 1
            if spins < _SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()  # more processes than cores: let the one we wait for run
            if deadline is None:
                deadline = time.monotonic() + self.timeout_s
            elif time.monotonic() > deadline:
                missing = [r for r in range(self.world) if self.published[r, 0] < self.calls]
                raise RuntimeError(
                    f"Rank {self.rank} waited {self.timeout_s:.0f} s for the gradients of rank(s) "
                    f"{missing}, which never arrived: those processes stopped or hang. Check their "
                    "output; HAPI_DIST_TIMEOUT sets this limit."
                )


def average_hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP communication hook: one bucket of gradients (a ``dist.GradBucket``), averaged
    through the :class:`SharedMemoryAllReduce` in ``state``; returns a completed future."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(state.average(bucket.buffer()))
    return future


def _rows_bytes(numel: int, world: int) -> int:
    """Bytes of the gradient rows: two halves of one float32 row per process."""
    return 2 * world * numel * 4


def _size(numel: int, world: int) -> int:
    """Bytes of the shared file: the rows, then one 64-byte line per process for its
    published call number."""
    return _rows_bytes(numel, world) + 64 * world


def _shm_dir() -> str:
    """RAM-backed /dev/shm where there is one, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
