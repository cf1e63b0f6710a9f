"""``hapi.spawn``: start a training function on several local processes.

Paddle's ``paddle.distributed.spawn(train, args, nprocs, gpus)`` on torch's
own elastic launcher (``torch.distributed.launcher.elastic_launch``, the
engine behind ``torchrun``): every child gets the torch.distributed
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), so a ``Model`` built inside ``fn`` trains distributed with
no change. When a child raises, the launcher stops the others (even those
waiting in a collective) and :func:`spawn` raises
:class:`SpawnedProcessError` carrying the child's error and traceback.

Start method. A script's children are started with ``spawn``: each imports the
script and looks ``fn`` up there. A notebook or an interactive session has no
file to import (``__main__`` has no ``__file__``), so a function defined there
cannot be found by a fresh process; there the children are forked instead, as
Lightning's ``ddp_notebook`` and Accelerate's ``notebook_launcher`` do, and
inherit ``fn`` as it is in memory.
"""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import tempfile
import traceback
from typing import Any, Callable, Sequence

import torch


class SpawnedProcessError(RuntimeError):
    """A process started by :func:`hapi.spawn` raised or died; raised in the parent.

    The message holds the first failing process's rank and traceback (or its
    exit code, when it died before it could report), so the cause reads in the
    parent's output even when the children's went to ``log_dir``. The other
    children were stopped before it is raised.
    """


# Set for the children: where each leaves its error for the parent's message. A child
# imports the user's script before it runs fn; seeing it there in a call to spawn means the
# script calls spawn at import time.
_ERROR_DIR = "HAPI_SPAWN_ERROR_DIR"
_UNGUARDED = (
    "the script calls hapi.spawn when it is imported, and each process hapi.spawn starts "
    "imports the script (as multiprocessing's spawn start method does), so every child "
    'called hapi.spawn again and died. Put the call under `if __name__ == "__main__":`.'
)

# A spawned child that dies before fn runs may not have found fn in the script it imported.
_NOT_FOUND = (
    ' If that output says "Can\'t get attribute", define fn at the top level of its module, '
    'outside `if __name__ == "__main__":`: each child imports the script and looks fn up there.'
)


# While spawn forks its processes: the caller's signal handlers, and whether the processes'
# output goes to log_dir ("to_files"). Read by _in_forked_child.
_forking: dict[str, Any] = {}


def _restore_signals(handlers: dict[signal.Signals, Any]) -> None:
    """Put back the handlers that ``handlers`` recorded (the launcher installs its own)."""
    for number, handler in handlers.items():
        if handler is not None and signal.getsignal(number) is not handler:
            signal.signal(number, handler)


def _in_forked_child() -> None:
    """Right after the fork, in each process spawn forks (an ``os.register_at_fork`` hook).

    The process gets the caller's signal handlers, not the launcher's: the
    launcher's SIGTERM handler would turn the launcher stopping the others after
    one failed into an error of this process's own. With ``log_dir``, Python's
    standard streams go on file descriptors 1 and 2: a notebook kernel's
    ``sys.stdout`` sends text to the notebook, not to a descriptor (and may have
    none), while the launcher sends each process's output to ``log_dir``'s files
    by redirecting its descriptors.
    """
    if _forking.get("to_files"):
        sys.stdout, sys.stderr = (
            open(fd, "w", buffering=1, closefd=False, errors="replace") for fd in (1, 2)
        )
    _restore_signals(_forking.pop("handlers", {}))  # none: a fork that is not spawn's
    _forking.clear()  # the process's own forks (DataLoader workers) are none of spawn's


if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(after_in_child=_in_forked_child)


def _forks() -> bool:
    """Whether spawn forks: no file to import fn from (a notebook, ``python -c``, the prompt)."""
    return not getattr(sys.modules["__main__"], "__file__", None)


def _visible_devices(gpus: str | Sequence[int] | None) -> str | None:
    """``gpus`` as a ``CUDA_VISIBLE_DEVICES`` value ("4,5"), or None."""
    if gpus is None:
        return None
    items = gpus.split(",") if isinstance(gpus, str) else list(gpus)
    ids = [str(item).strip() for item in items if str(item).strip() != ""]
    if not ids or not all(item.isdigit() for item in ids):
        raise ValueError(
            f"gpus must list device numbers, e.g. gpus='4,5' or gpus=[4, 5]; received {gpus!r}."
        )
    return ",".join(ids)


def resolve_nprocs(nprocs: int, visible_devices: str | None) -> int:
    """Paddle's rule: ``-1`` means one process per selected GPU, else per visible GPU, else per CPU."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or (nprocs < 1 and nprocs != -1):
        raise ValueError(
            f"nprocs must be a positive integer or -1 (one per device); received {nprocs!r}."
        )
    if nprocs != -1:
        return nprocs
    if visible_devices is not None:
        return len(visible_devices.split(","))
    return torch.cuda.device_count() if torch.cuda.is_available() else os.cpu_count() or 1


def spawn(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = -1,
    gpus: str | Sequence[int] | None = None,
    log_dir: str | None = None,
) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``nprocs`` local processes that train together.

    Args:
        fn: the function each process runs. From a script: a module-level
            function (children import the script, as with ``multiprocessing``'s
            spawn start method; guard the call with ``if __name__ ==
            "__main__":``). From a notebook or an interactive session: any
            function, defined there or imported (the children are forked).
        args: positional arguments for ``fn``.
        nprocs: processes to start; ``-1`` starts one per GPU in ``gpus``,
            else one per visible GPU, else one per CPU core.
        gpus: device numbers to use, ``"4,5"`` or ``[4, 5]`` (Paddle's
            ``gpus=``): children see only those (``CUDA_VISIBLE_DEVICES``) and
            rank i uses the i-th.
        log_dir: keep each process's output in ``<log_dir>/workerlog.<rank>``
            (Paddle's ``launch --log_dir``); rank 0 still prints to the console.
            What a process prints before it runs ``fn`` (importing the script)
            stays on the console.

    Threads: unless ``OMP_NUM_THREADS`` is set, each of N > 1 children gets
    ``cpu_count // N`` intra-op threads, so the processes do not fight over cores.

    Signals: while the processes run, the launcher handles SIGTERM, SIGINT,
    SIGHUP and SIGQUIT (it stops the children); SIGINT (Ctrl-C, a notebook's
    interrupt button) then raises ``KeyboardInterrupt``. When ``spawn``
    returns or raises, the caller's own handlers are back, so a notebook kernel
    shuts down as it did before.

    Returns:
        ``{rank: fn's return value}``.

    Raises:
        SpawnedProcessError: a child raised or died; the message carries the
            first failure's error and traceback, and names the ``log_dir``
            files that hold output. The other children are stopped first
            (within about a second), even inside a collective. A script that
            calls ``spawn`` at import time, outside ``if __name__ ==
            "__main__":``, gets this error naming that cause.
        RuntimeError: called from a notebook or an interactive session after
            this process initialised CUDA: forked children cannot use CUDA
            then (restart the kernel and call ``spawn`` before any CUDA work,
            or run the training as a script).
    """
    if not callable(fn):
        raise TypeError(f"spawn needs a function to run; received {type(fn).__name__}.")
    if os.environ.get(_ERROR_DIR):  # a child importing the script: tell the parent why
        pathlib.Path(os.environ[_ERROR_DIR], "unguarded").write_text(_UNGUARDED)
        raise RuntimeError(f"hapi.spawn in a process it started: {_UNGUARDED}")
    from unittest import mock

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    visible = _visible_devices(gpus)
    if visible is not None and not torch.cuda.is_available():
        raise RuntimeError(
            f"spawn(gpus={gpus!r}) selects GPUs, but torch.cuda.is_available() is False on this "
            "machine. Leave gpus=None to train on CPU processes."
        )
    count = resolve_nprocs(nprocs, visible)
    start_method = "fork" if _forks() else "spawn"
    if start_method == "fork" and torch.cuda.is_initialized():
        raise RuntimeError(
            "hapi.spawn forks its processes here (a notebook or an interactive session), but this "
            "process has already initialised CUDA, which a forked process cannot use. Restart the "
            "kernel and call hapi.spawn before any GPU work (build models inside fn), or run the "
            "training as a script."
        )
    run_id = f"hapi-{os.urandom(4).hex()}"
    redirect = {"redirects": Std.ALL, "tee": {0: Std.ALL}} if log_dir else {}
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=count,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # a free port, as torchrun --standalone picks it
        rdzv_configs={"timeout": 120},
        max_restarts=0,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir or os.devnull, **redirect),
        shutdown_timeout=5,
    )
    updates = {"CUDA_VISIBLE_DEVICES": visible} if visible is not None else {}
    if count > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Like torchrun, never let N processes each start one thread per core
        # (measured here: 2 processes x 2 threads on 2 cores ran 3x slower);
        # unlike torchrun's 1, share the cores out, which CPU training needs.
        updates["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // count))
    # The launcher installs its own handlers for SIGTERM, SIGINT, ... and leaves them.
    handlers = {number: signal.getsignal(number) for number in signal.valid_signals()}
    with tempfile.TemporaryDirectory(prefix="hapi-spawn-") as error_dir:
        try:
            if start_method == "fork":
                _forking.update(handlers=handlers, to_files=log_dir is not None)
            # Children inherit the parent's environment: set for the launch only.
            with mock.patch.dict(os.environ, {**updates, _ERROR_DIR: error_dir}):
                return elastic_launch(config, _run_child)(fn, args)
        except ChildFailedError as error:
            failure = error
        except SignalException as error:  # the launcher's handler: Ctrl-C, a notebook's stop
            if error.sigval != signal.SIGINT:
                raise
            raise KeyboardInterrupt("hapi.spawn: its processes were stopped.") from None
        finally:
            _forking.clear()
            _restore_signals(handlers)
            logs = _name_worker_logs(log_dir, run_id) if log_dir else {}
        raise SpawnedProcessError(_failure_report(failure, error_dir, count, log_dir, logs))


def _run_child(fn: Callable[..., Any], args: tuple) -> Any:
    """Runs in each child: keeps the traceback of an error for the parent to show."""
    error_dir = os.environ.pop(_ERROR_DIR)  # fn may start a spawn of its own
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # a forked child kept its parent's thread pool
        torch.set_num_threads(int(threads))
    try:
        return fn(*args)
    except BaseException:
        from hapi import distributed

        distributed.note_failure()  # multiprocessing catches it: sys.excepthook never sees it
        report = pathlib.Path(error_dir, f"error.{os.environ.get('RANK', '0')}")
        report.write_text(traceback.format_exc())
        raise


def _failure_report(
    error: Any, error_dir: str, count: int, log_dir: str | None, logs: dict[str, str]
) -> str:
    """The first child's own traceback, or what the launcher knows when it left none."""
    if os.path.exists(os.path.join(error_dir, "unguarded")):
        return f"hapi.spawn could not start its {count} processes: {_UNGUARDED}"
    where = f" Each process's output is in {', '.join(logs.values())}." if logs else ""
    if log_dir and not logs:
        where = f" No process wrote anything to {log_dir}: they died before any output went there."
    # The first report written is the root cause; later ones are ranks that lost their
    # peer ("Connection closed by peer") because of it. So are all reports when none is of
    # a process the launcher saw exit: those died without one (os._exit, a signal).
    reports = sorted(pathlib.Path(error_dir).glob("error.*"), key=lambda p: p.stat().st_mtime_ns)
    if {int(p.suffix[1:]) for p in reports} & set(error.failures):
        return (
            f"Process {reports[0].suffix[1:]} of {count} started by hapi.spawn raised an error; "
            f"the other processes were stopped.{where}\n{reports[0].read_text().rstrip()}"
        )
    rank, failure = error.get_first_failure()
    output = f"in {logs[str(rank)]}" if str(rank) in logs else "above"
    hint = "" if _forks() else _NOT_FOUND  # forked: nothing was imported, the cause is in fn
    return (
        f"Process {rank} of {count} started by hapi.spawn died with exit code {failure.exitcode} "
        f"before it could report an error; its output is {output}.{where}{hint}"
    )


def _name_worker_logs(log_dir: str, run_id: str) -> dict[str, str]:
    """Give the launcher's per-rank files Paddle's names, ``workerlog.<rank>``; returns the
    files this run wrote something to, by rank (a ``log_dir`` used before keeps older output).

    The launcher writes ``<log_dir>/<run_id>_<suffix>/attempt_<n>/<local_rank>/{stdout,stderr}.log``
    (live, while the processes run); its directories that stayed empty (processes that died
    before their output went there) are removed.
    """
    from hapi.checkpoint import files

    written = {}  # rank -> its workerlog, when this run added output to it (not an earlier run)
    sources = pathlib.Path(log_dir).glob(f"{run_id}_*/attempt_*/*/std*.log")
    for source in sorted(sources, key=lambda path: (path.parent, path.name == "stderr.log")):
        target = os.path.join(log_dir, f"workerlog.{source.parent.name}")
        with open(target, "a", encoding="utf-8") as log:
            if log.write(source.read_text(encoding="utf-8", errors="replace")):
                written[source.parent.name] = target
    for run_dir in list(pathlib.Path(log_dir).glob(f"{run_id}_*")):
        for directory, _, _ in os.walk(run_dir, topdown=False):
            files.remove_empty_directory(directory)
    return dict(sorted(written.items()))
