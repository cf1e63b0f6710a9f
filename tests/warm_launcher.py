"""torchrun's own agent, forked from a warm interpreter instead of started cold.

Every ``python -m torch.distributed.run ...`` pays ``import torch`` (about 1.9 s of CPU on
the 2-core test machine) in the agent before its workers even start, and the test suite
launches torchrun well over a hundred times. A small server process imports
``torch.distributed.run`` once; for each launch it forks, and the child runs torchrun's
``main`` with the launch's arguments, environment, working directory and output files:
the same agent code, rendezvous, worker processes and exit codes as the command line, so
the tests still exercise torchrun for real. The workers are started by the agent as
always, as fresh interpreters.

One launch at a time per server (tests launch one after another); a test that needs two
agents at once starts them as commands (``dist_helpers.two_machines``).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

_SERVER = r"""
import json, os, sys, traceback
import torch.distributed.run as torchrun  # the import every cold launch pays again

replies = os.fdopen(int(sys.argv[1]), "w", buffering=1)
for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()  # its own process group, as a command started in a new session
            replies.close()
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            sys.argv = ["torchrun", *request["args"]]
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
    replies.write(json.dumps({"pid": pid}) + "\n")
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
"""


class WarmTorchrun:
    """A server that forks torchrun agents from an interpreter that imported torch once."""

    def __init__(self, env: dict[str, str]) -> None:
        read_end, write_end = os.pipe()
        self._server = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(write_end)],
            stdin=subprocess.PIPE,
            text=True,
            env=env,
            pass_fds=(write_end,),
            start_new_session=True,
        )
        os.close(write_end)
        self._replies = os.fdopen(read_end, "r", buffering=1)
        self._lock = threading.Lock()

    def alive(self) -> bool:
        return self._server.poll() is None

    def close(self) -> None:
        if self.alive():
            self._server.stdin.close()
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
        self._replies.close()

    def run(
        self, args: list[str], timeout: float, env: dict[str, str], cwd: str | os.PathLike
    ) -> tuple[int, str, str, bool]:
        """(exit code, stdout, stderr, timed out) of ``torchrun *args``."""
        with self._lock, tempfile.TemporaryDirectory(prefix="warm-torchrun-") as folder:
            stdout_path = os.path.join(folder, "stdout")
            stderr_path = os.path.join(folder, "stderr")
            for path in (stdout_path, stderr_path):
                open(path, "w").close()
            request = {
                "args": [str(arg) for arg in args],
                "env": env,
                "cwd": os.fspath(cwd),
                "stdout": stdout_path,
                "stderr": stderr_path,
            }
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
            pid = self._reply(deadline=time.monotonic() + 30)["pid"]
            reply = self._reply(deadline=time.monotonic() + timeout)
            timed_out = reply is None
            if timed_out:
                _kill_tree(pid)
                reply = self._reply(deadline=time.monotonic() + 30)
            with open(stdout_path) as out, open(stderr_path) as err:
                return (reply or {}).get("returncode", -9), out.read(), err.read(), timed_out

    def _reply(self, deadline: float) -> dict | None:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._replies], [], [], left)
            if ready:
                line = self._replies.readline()
                if not line:
                    raise RuntimeError("the warm torchrun server exited")
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


def _kill_tree(pid: int) -> None:
    """SIGKILL the agent and every process under it: torchrun starts each worker in a
    session of its own, so killing the agent's group would leave them running."""
    pending, tree = [pid], []
    while pending:
        current = pending.pop()
        tree.append(current)
        pending.extend(_children(current))
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


_server: WarmTorchrun | None = None


def server(env: dict[str, str]) -> WarmTorchrun:
    """This test process's server, started on first use (again if it died)."""
    global _server
    if _server is None or not _server.alive():
        _server = WarmTorchrun(env)
        atexit.register(_server.close)
    return _server
