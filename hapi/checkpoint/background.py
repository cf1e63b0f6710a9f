"""Saves that run beside training: one write at a time per process, each of one moment.

A background save returns once the state is copied; a thread writes it
(:class:`_BackgroundWrite`). What the thread writes must be the state *at the
call*: :func:`snapshot` copies every tensor and every container then, so that
training going on (running sums updated in place, a callback appending to its
lists) never reaches the file. The copies of a plain save go into buffers
reused from one save to the next (:func:`snapshot` with ``reuse``).

Every process calls a save, so every process knows one is under way
(``background.started``): a load then waits for it on every process
(:func:`wait_if_saving`), not only on the one that writes, which would read
the previous file.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator

import torch

from hapi import distributed
from hapi.checkpoint.errors import CheckpointError
from hapi.distributed.collectives import attempt


class _BackgroundWrite:
    """At most one checkpoint write running beside training, in each process.

    The last save that returned must be on disk when the process ends, also
    after Ctrl-C. ``Thread.join`` cannot promise it: interrupted by
    ``KeyboardInterrupt``, CPython 3.11 marks the running thread as ended, so
    the interpreter's exit no longer waits for it and kills it mid-write
    (the previous file stays, or ``terminate called without an active
    exception`` aborts the process from inside torch's writer). So the
    thread is a daemon that the interpreter never joins: :meth:`join` waits
    on an event with Ctrl-C deferred (:func:`_interrupts_deferred`), and so
    does an exit hook, which runs on every exit but ``os._exit`` and a fatal
    signal.
    """

    def __init__(self) -> None:
        self._write: concurrent.futures.Future | None = None
        self._target = ""
        # Set on every process by a background save (each calls it), cleared once
        # all have waited: the same on every process, so a load may wait collectively.
        self.started = False

    def start(self, write: Callable[[], None], target: str) -> None:
        self.join()
        future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(write())
            except BaseException as error:  # noqa: BLE001 -- reported by join() on the main thread
                future.set_exception(error)

        with _interrupts_deferred():  # a thread started is a thread waited for
            threading.Thread(target=run, name="hapi-checkpoint-write", daemon=True).start()
            self._target, self._write = target, future

    def join(self) -> None:
        """Wait for the running write; raise its error (once).

        A Ctrl-C while waiting is raised once the write has ended (the
        write's own error is then kept for the next wait).
        """
        if self._write is None:
            return
        with _interrupts_deferred(
            f"Waiting for the checkpoint {self._target!r} being written in the background "
            "to be whole on disk."
        ):
            self._write.exception()  # waits for it to end
        write, self._write = self._write, None
        write.result()  # raises its CheckpointError: each write names its file and the cause

    def forget(self) -> None:
        """In a forked child (a DataLoader worker): the parent's write is not this process's
        to wait for; its thread was not copied, so the wait would never end."""
        self._write, self.started = None, False

    def join_at_exit(self) -> None:
        """At interpreter exit: wait for the write; its failure is printed, as exit cannot raise."""
        try:
            self.join()
        except KeyboardInterrupt:
            self.join_at_exit()  # the write has ended: say if it failed
        except Exception as error:  # noqa: BLE001 -- the process is ending: say it, do not lose it
            sys.stderr.write(f"torch-hapi: {error}\n")


@contextlib.contextmanager
def _interrupts_deferred(notice: str = "") -> Iterator[None]:
    """SIGINT (Ctrl-C) inside the block is delivered at its end, once; ``notice`` is printed then.

    On the main thread only (the only one signals reach in Python); the
    handler in force (``KeyboardInterrupt``, or the user's own) then runs.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is None  # a handler not set from Python: no putting it back
    ):
        yield
        return
    received = []

    def defer(number: int, frame: Any) -> None:
        if notice and not received:
            sys.stderr.write(notice + "\n")
        received.append(number)

    previous = signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        signal.raise_signal(signal.SIGINT)


background = _BackgroundWrite()
# Before any exit hook of the user's (one may destroy the process group a sharded write
# needs), as a non-daemon thread would be waited for: CPython's private hook for exactly
# that (3.9 and later; tests/hapi/test_interrupted_saves.py fails if it goes).
threading._register_atexit(background.join_at_exit)
os.register_at_fork(after_in_child=background.forget)


def agree(action: Callable[[], None], target: str) -> None:
    """``action()`` on every process; a failure on any is raised on all."""
    failure = attempt(action)[1]
    if distributed.any_true(failure is not None):
        raise failure or CheckpointError(
            f"Another process failed to write the checkpoint {target!r}; see its error."
        )


def wait_for_writes() -> None:
    """Every process waits until its background write (if any) is on disk.

    A collective. Raises on every process when a write failed on any.
    """
    background.started = False
    agree(background.join, "written in the background")


def wait_if_saving() -> None:
    """Before reading: wait for a background save on every process, if one was started.

    Only the main process writes, so waiting for one's own thread is not
    enough: another process would read the previous file. Collective when a
    background save was started (every process started it, so every process
    waits here); nothing at all otherwise, so a load on one process alone
    still works.
    """
    if background.started:
        wait_for_writes()
    else:
        background.join()


def rebuild(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with ``leaf(x)`` for each ``x`` that is no dict, list or tuple, the containers
    rebuilt around the results (in order: the same state is walked the same way each time).

    A dict or ``OrderedDict`` keeps its type; any other mapping becomes a dict.
    """
    if isinstance(value, dict):
        rebuilt = type(value)() if type(value) in (dict, collections.OrderedDict) else {}
        rebuilt.update((key, rebuild(item, leaf)) for key, item in value.items())
        return rebuilt
    if type(value) in (list, tuple):
        return type(value)(rebuild(item, leaf) for item in value)
    return leaf(value)


# CPU copies of the last plain background save's tensors, reused by the next (see snapshot).
_staged: list[torch.Tensor] = []


def snapshot(value: Any, reuse: bool = False) -> Any:
    """``value`` as it is now: tensors copied (to CPU memory), containers and the rest deep-copied.

    For states written later from a thread: nothing in the copy is shared
    with live objects that training goes on changing. With ``reuse`` the
    tensors go into the buffers of the previous such call where they fit
    (the same shapes and dtypes, as a backup of the same model has): that
    spares allocating and faulting in a fresh copy each time, about a third
    of the copy's cost for a 300 MB state. Call it so only once the write
    that read those buffers has ended.
    """
    previous, kept = iter(_staged if reuse else []), []

    def copied(leaf: Any) -> Any:
        if not torch.is_tensor(leaf):
            return copy.deepcopy(leaf)
        buffer = next(previous, None)
        same = buffer is not None and buffer.shape == leaf.shape and buffer.dtype == leaf.dtype
        if same and buffer.layout == leaf.layout and leaf.is_contiguous():
            buffer.copy_(leaf.detach())
        else:
            buffer = leaf.detach().to("cpu", copy=True)
        kept.append(buffer)
        return buffer

    result = rebuild(value, copied)
    if reuse:
        _staged[:] = kept
    return result


def release_staging() -> None:
    """Free the CPU copies kept for the next background save (once saves are done, say)."""
    background.join()
    _staged.clear()
