"""``torchrun ARGS...`` through the tests' warm launcher, as a command a script can run.

``python warm_torchrun.py SOCKET ARGS...`` asks the warm launcher's server listening on
SOCKET (see warm_launcher) to fork a torchrun agent with this process's standard streams,
environment and working directory, forwards SIGTERM, SIGINT and SIGHUP to it, and exits
with its exit status. It imports no torch, so it starts in milliseconds; the agent and
its workers are forked warm. ``dist_helpers.torchrun_command`` gives the command line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys


def main(argv: list[str]) -> int:
    path, *args = argv
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    request = {"kind": "torchrun", "args": args, "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    pid = json.loads(conn.recv(1 << 20))["pid"]

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    reply = json.loads(conn.recv(1 << 20) or "null")
    if reply is None:
        return 1  # the server went away
    code = reply["returncode"]
    return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
