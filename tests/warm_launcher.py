"""Python processes for the tests, forked from a warm interpreter instead of started cold.

Every ``python ...`` pays ``import torch`` (about 2 s of CPU on the 2-core test machine)
before it does anything, and the test suite starts several hundred: torchrun agents,
their workers, and single-process training scripts. A small server process imports
``torch.distributed.run`` once and then forks, for each launch:

* a torchrun agent (:meth:`WarmPython.torchrun`): the child runs torchrun's ``main`` with
  the launch's arguments, environment, working directory and output files -- the same
  agent code, rendezvous, restarts and exit codes as the command line, so the tests still
  exercise torchrun for real;
* each worker that agent starts: torchrun's ``SubprocessHandler`` is patched, in the
  agent only, to ask the server over a Unix socket for a fork instead of running
  ``python -u script ...``; the agent watches, signals and reaps it as it would its
  ``Popen`` (process id, ``poll``, ``wait``, ``killpg`` of its session);
* a plain script run (:meth:`WarmPython.python`), as ``python script ...``;
* a torchrun agent asked for by ``python tests/warm_torchrun.py SOCKET ARGS...``, a
  command that stands in for ``torchrun ARGS...`` where a script the tests run starts
  torchrun itself (``dist_helpers.torchrun_command``).

A forked script starts as a fresh interpreter would for what the tests can see: its
own session, standard streams, working directory, environment, ``sys.argv``,
``sys.path`` (the script's folder, then ``PYTHONPATH``, then the installation's),
unbuffered output under ``PYTHONUNBUFFERED``/``-u``, torch's thread count from
``OMP_NUM_THREADS``, Python's and NumPy's global random state drawn anew, and a normal
interpreter exit (threads joined, ``atexit`` handlers run, an uncaught exception's
traceback and exit status 1). What it cannot redo: string hashing keeps the server's
seed, and the libraries the server imported (torch, NumPy, torchmetrics, pytest) are
imported already; hapi is not. ``tests/distributed/
test_warm_launcher.py`` compares each kind with the cold command.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

_SERVER = r"""
import gc, io, json, os, random, runpy, select, selectors, socket, subprocess, sys, traceback
import torch
import torch.distributed.run as torchrun
# What the tests' scripts import besides torch, paid once here (seconds per process):
import numpy, pytest, torchmetrics, torch.distributed.checkpoint, torch.distributed.fsdp
from torch.distributed.elastic.multiprocessing.subprocess_handler import (
    subprocess_handler as handlers,
)

replies = os.fdopen(int(sys.argv[1]), "w", buffering=1)
SOCKET = sys.argv[2]
_own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
BASE_PATH = [p for p in sys.path[1:] if p not in _own]  # the installation's part


def read_message(conn, timeout=None):
    ready, _, _ = select.select([conn], [], [], timeout)
    return json.loads(conn.recv(1 << 20) or "null") if ready else None


class WarmWorker:
    # What torchrun's SubprocessHandler uses of the Popen of "python -u script ...".

    def __init__(self, args, env, stdout, stderr):
        self.args = list(args)
        self.returncode = None
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(SOCKET)
        fds = [0, stdout.fileno() if stdout else 1, stderr.fileno() if stderr else 2]
        request = {"argv": self.args[2:], "env": env, "cwd": os.getcwd(), "unbuffered": True}
        socket.send_fds(self._conn, [json.dumps(request).encode()], fds)
        self.pid = read_message(self._conn)["pid"]

    def poll(self):
        return self.wait(0, raise_on_timeout=False)

    def wait(self, timeout=None, raise_on_timeout=True):
        if self.returncode is None:
            reply = read_message(self._conn, timeout)
            if reply is not None:
                self.returncode = reply["returncode"]
                self._conn.close()
            elif raise_on_timeout:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(9)

    def terminate(self):
        self.send_signal(15)


_cold_popen = handlers.SubprocessHandler._popen


def _warm_popen(self, args, env):
    if len(args) > 2 and args[0] == sys.executable and args[1] == "-u" and args[2][:1] != "-":
        return WarmWorker(args, env, self._stdout, self._stderr)
    return _cold_popen(self, args, env)  # torchrun --module, --no-python: a real command


def become(request, fds):
    # Turn this forked child into the process the request describes (see the module doc).
    os.setsid()  # its own session and process group, as Popen(start_new_session=True)
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # A fresh torch reads OMP_NUM_THREADS, else uses every core it may run on.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0))))
    random.seed()
    numpy.random.seed()


def forget_server():
    # In a forked child: drop the server's sockets and descriptors.
    selector.close()
    listener.close()
    replies.close()
    for pidfd, (_, where) in children.items():
        os.close(pidfd)
        if where is not None:
            where.close()


def run_agent(request, fds=None):
    code = 1
    try:
        if fds is None:
            fds = [os.open(os.devnull, os.O_RDONLY)] + [
                os.open(request[k], os.O_WRONLY | os.O_TRUNC) for k in ("stdout", "stderr")
            ]
        become(request, fds)
        sys.argv = ["torchrun", *request["args"]]
        handlers.SubprocessHandler._popen = _warm_popen
        try:
            torchrun.main(request["args"])
            code = 0
        except SystemExit as stop:  # as the interpreter turns it into an exit status
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
    finally:
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)


# What is loaded now stays out of the collector's reach in every fork: their collections
# and exit would otherwise write to (and so copy) every page of it (an exit: 3 s -> 0.8 s).
gc.freeze()
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(SOCKET)
listener.listen(64)
replies.write(json.dumps({"ready": True}) + "\n")
selector = selectors.DefaultSelector()
selector.register(0, selectors.EVENT_READ, "request")
selector.register(listener, selectors.EVENT_READ, "worker")
children = {}  # pidfd -> (pid, where its exit status goes: None for the test, else a socket)
pending = b""
script = None  # set in a forked child that is to run a script
while script is None:
    for key, _ in selector.select():
        started = None
        if key.data == "request":  # from the test process: one JSON line per launch
            chunk = os.read(0, 1 << 20)
            if not chunk:
                sys.exit(0)
            pending += chunk
            while b"\n" in pending and script is None:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush(); sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    forget_server()
                    if request["kind"] == "torchrun":
                        run_agent(request)
                    fds = [os.open(os.devnull, os.O_RDONLY)] + [
                        os.open(request[k], os.O_WRONLY | os.O_TRUNC) for k in ("stdout", "stderr")
                    ]
                    script = request, fds
                    break
                replies.write(json.dumps({"pid": pid}) + "\n")
                started = pid, None
        elif key.data == "worker":  # from an agent: one of its workers; or warm_torchrun.py
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                forget_server()
                conn.close()
                if request.get("kind") == "torchrun":
                    run_agent(request, fds)
                script = request, fds
                break
            for fd in fds:
                os.close(fd)
            try:
                conn.send(json.dumps({"pid": pid}).encode())
            except OSError:
                pass
            started = pid, conn
        else:  # a child exited
            pid, where = children.pop(key.fd)
            selector.unregister(key.fd)
            os.close(key.fd)
            status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            reply = json.dumps({"pid": pid, "returncode": status})
            if where is None:
                replies.write(reply + "\n")
            else:
                try:
                    where.send(reply.encode())
                except OSError:
                    pass  # the agent is gone
                where.close()
        if started is not None:
            pidfd = os.pidfd_open(started[0])
            children[pidfd] = started
            selector.register(pidfd, selectors.EVENT_READ, "child")
        if script is not None:
            break

del listener, selector, children, replies
request, fds = script
become(request, fds)
del script, fds
path, *rest = request["argv"]
sys.argv = [path, *rest]
sys.path[:] = [
    os.path.dirname(os.path.realpath(path)),
    *(os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p),
    *BASE_PATH,
]
unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
encoding = {"encoding": sys.__stdout__.encoding, "errors": sys.__stdout__.errors}
sys.stdin = sys.__stdin__ = open(0, "r", closefd=False, encoding=encoding["encoding"])
sys.stdout = sys.__stdout__ = io.TextIOWrapper(
    open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
    write_through=unbuffered, **encoding
)
sys.stderr = sys.__stderr__ = io.TextIOWrapper(
    open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),
    line_buffering=True, write_through=unbuffered, encoding=encoding["encoding"],
    errors="backslashreplace",
)
del path, rest, request, encoding, unbuffered
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class WarmPython:
    """A server that forks torchrun agents, their workers and scripts from an interpreter
    that imported torch once."""

    def __init__(self, env: dict[str, str]) -> None:
        self._folder = tempfile.mkdtemp(prefix="warm-python-")
        read_end, write_end = os.pipe()
        self.socket = os.path.join(self._folder, "socket")  # for warm_torchrun.py
        self._server = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(write_end), self.socket],
            stdin=subprocess.PIPE,
            text=True,
            env=env,
            pass_fds=(write_end,),
            start_new_session=True,
        )
        os.close(write_end)
        self._replies = read_end
        self._pending = b""
        self._lock = threading.Lock()
        self._exited: dict[int, int] = {}  # process id -> exit status, not yet collected
        self._ready = False

    def alive(self) -> bool:
        return self._server.poll() is None

    def close(self) -> None:
        if self.alive():
            self._server.stdin.close()
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
        os.close(self._replies)
        for name in os.listdir(self._folder):
            os.unlink(os.path.join(self._folder, name))
        os.rmdir(self._folder)

    def torchrun(
        self, args: list[str], timeout: float, env: dict[str, str], cwd: str | os.PathLike
    ) -> tuple[int, str, str, bool]:
        """(exit code, stdout, stderr, timed out) of ``torchrun *args``."""
        return self.wait(self.start("torchrun", args, env, cwd), timeout)

    run = torchrun  # the name the tests have used

    def python(
        self, argv: list[str], timeout: float, env: dict[str, str], cwd: str | os.PathLike
    ) -> tuple[int, str, str, bool]:
        """(exit code, stdout, stderr, timed out) of ``python *argv`` (argv[0]: a script)."""
        return self.wait(self.start("python", argv, env, cwd), timeout)

    def start(self, kind: str, args: list, env: dict[str, str], cwd) -> tuple[int, str]:
        """Starts ``torchrun *args`` or ``python *args`` (``kind``) without waiting for it
        (several may run at once, as two machines' agents); returns what :meth:`wait` takes."""
        folder = tempfile.mkdtemp(prefix="warm-run-")
        for name in ("stdout", "stderr"):
            open(os.path.join(folder, name), "w").close()
        args = [str(arg) for arg in args]
        request = {
            "kind": kind,
            "args": args,
            "argv": args,
            "env": env,
            "cwd": os.path.abspath(cwd),
            "stdout": os.path.join(folder, "stdout"),
            "stderr": os.path.join(folder, "stderr"),
            "unbuffered": False,
        }
        self.wait_ready()
        with self._lock:
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
            while True:  # the next reply without an exit status is this one's process id
                reply = self._reply(deadline=time.monotonic() + 60)
                if reply is None:
                    raise RuntimeError("the warm python server did not start the process")
                if "returncode" not in reply:
                    return reply["pid"], folder
                self._exited[reply["pid"]] = reply["returncode"]

    def wait_ready(self) -> None:
        """Returns once the server has imported what it imports and listens on its socket."""
        with self._lock:
            if not self._ready:
                reply = self._reply(deadline=time.monotonic() + 600)
                if reply != {"ready": True}:
                    raise RuntimeError(f"the warm python server did not start: {reply}")
                self._ready = True

    def wait(self, launch: tuple[int, str], timeout: float) -> tuple[int, str, str, bool]:
        """(exit code, stdout, stderr, timed out) of a :meth:`start`; at the time limit, it
        is killed with every other process the server started (its workers are the
        server's children, not the agent's)."""
        pid, folder = launch
        timed_out = False
        deadline = time.monotonic() + timeout
        with self._lock:
            while pid not in self._exited:
                reply = self._reply(deadline)
                if reply is None:
                    if timed_out:
                        break  # not even SIGKILL ended it in 30 s
                    timed_out = True
                    _kill_tree(self._server.pid, spare_root=True)
                    deadline = time.monotonic() + 30
                elif "returncode" in reply:
                    self._exited[reply["pid"]] = reply["returncode"]
        with (
            open(os.path.join(folder, "stdout")) as out,
            open(os.path.join(folder, "stderr")) as err,
        ):
            outputs = out.read(), err.read()
        shutil.rmtree(folder, ignore_errors=True)
        return self._exited.pop(pid, -9), *outputs, timed_out

    def _reply(self, deadline: float) -> dict | None:
        """The server's next reply line, or None at the deadline. Read from the pipe
        itself, not a buffered file: two replies may arrive at once (a process id, then
        an exit status), and a buffer would hide the second from select."""
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._replies], [], [], left)
            if ready:
                chunk = os.read(self._replies, 1 << 16)
                if not chunk:
                    raise RuntimeError("the warm python server exited")
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _kill_tree(pid: int, spare_root: bool = False) -> None:
    """SIGKILL ``pid`` (unless spared) and every process under it: torchrun starts each
    worker in a session of its own, so killing a process group would leave some running."""
    pending, tree = [pid], []
    while pending:
        current = pending.pop()
        tree.append(current)
        pending.extend(_children(current))
    for member in tree[1:] if spare_root else tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


_server: WarmPython | None = None


def server(env: dict[str, str]) -> WarmPython:
    """This test process's server, started on first use (again if it died)."""
    global _server
    if _server is None or not _server.alive():
        _server = WarmPython(env)
        atexit.register(_server.close)
    return _server
