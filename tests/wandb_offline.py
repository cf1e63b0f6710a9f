"""Run wandb offline in tests, prove it never reaches the network, and read what it wrote.

* the fixture ``wandb_offline`` (import :func:`wandb_offline_fixture` into a
  test module to use it) sets wandb's environment for offline work in
  ``tmp_path`` and forbids, in this process, any socket connection or name lookup for a host other than localhost: an
  attempt is recorded and fails the test at teardown even if wandb swallowed
  the error. wandb's service (``wandb-core``, a separate process started on
  the first ``wandb.init``) is outside that guard, so its server address
  (``WANDB_BASE_URL``) and its HTTP(S) proxy both point at a listener on
  localhost that counts connections: the test fails if it got any.
* :func:`read_run` reads an offline run's ``run-<id>.wandb`` file: the
  records wandb itself wrote (its protobuf ``Record``), so a test checks the
  values a user would upload with ``wandb sync``.
"""

from __future__ import annotations

import json
import pathlib
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import pytest

_LOCAL_HOSTS = {"127.0.0.1", "::1", "localhost", "0.0.0.0", "", None}


class _Listener:
    """A TCP listener on localhost that accepts, counts and closes every connection."""

    def __init__(self) -> None:
        self.connections = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            connection, _ = self._server.accept()
            self.connections += 1
            connection.close()


_listener: _Listener | None = None


def _shared_listener() -> _Listener:
    # One for the whole session: wandb-core outlives a test and keeps its environment.
    global _listener
    if _listener is None:
        _listener = _Listener()
    return _listener


def _host(address) -> str | None:
    return address[0] if isinstance(address, tuple) else None  # AF_UNIX: a path


@dataclass
class Offline:
    """What the fixture gives a test: where wandb writes, and the attempts it saw."""

    dir: pathlib.Path
    attempts: list = field(default_factory=list)

    def runs(self) -> list[RunFile]:
        """Every offline run under :attr:`dir`, read with :func:`read_run`, in start order."""
        runs = [read_run(d) for d in (self.dir / "wandb").glob("offline-run-*")]
        return sorted(runs, key=lambda r: (r.run.start_time.seconds, r.run.start_time.nanos))


@pytest.fixture(name="wandb_offline")
def wandb_offline_fixture(tmp_path, monkeypatch):
    import wandb

    listener = _shared_listener()
    home = tmp_path / "wandb-home"
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_QUIET": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_CONSOLE": "off",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_X_DISABLE_MACHINE_INFO": "true",
        "WANDB_X_SAVE_REQUIREMENTS": "false",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_BASE_URL": listener.url,
        "HTTP_PROXY": listener.url,
        "HTTPS_PROXY": listener.url,
        "http_proxy": listener.url,
        "https_proxy": listener.url,
        "NO_PROXY": "",
        "no_proxy": "",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)

    offline = Offline(tmp_path)
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex
    getaddrinfo = socket.getaddrinfo

    def guard(what, host):
        if host not in _LOCAL_HOSTS:
            offline.attempts.append(f"{what} {host}")
            raise ConnectionRefusedError(f"test: no network ({what} {host})")

    def guarded_connect(sock, address):
        guard("connect", _host(address))
        return connect(sock, address)

    def guarded_connect_ex(sock, address):
        guard("connect_ex", _host(address))
        return connect_ex(sock, address)

    def guarded_getaddrinfo(host, *args, **kwargs):
        guard("getaddrinfo", host.decode() if isinstance(host, bytes) else host)
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", guarded_connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
    before = listener.connections
    yield offline
    if wandb.run is not None:  # a test that failed half-way: leave nothing to the next one
        wandb.run.finish()
    assert offline.attempts == [], f"wandb tried to reach the network: {offline.attempts}"
    assert listener.connections == before, "wandb-core connected to its server or proxy"


def _chunks(data: bytes):
    """The records of a LevelDB-style log (wandb's .wandb format): 32 KiB blocks of
    [crc32 u32, length u16, type u8, payload]; type 1 whole, 2/3/4 first/middle/last."""
    block, pos, pending = 32768, 7, b""  # after the 7-byte ':W&B' header
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block  # the block's zero-filled tail
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload
        else:
            return


@dataclass
class RunFile:
    """An offline run as wandb recorded it."""

    run: object  # wandb's RunRecord: project, display_name, job_type, ...
    history: list[dict]  # each logged row, without wandb's own _step/_runtime/_timestamp
    metrics: dict[str, str]  # define_metric: name or glob -> its step metric ("" for none)
    exit_code: int | None  # None: the run was never finished


def read_run(run_dir: pathlib.Path, timeout: float = 10.0) -> RunFile:
    """The run in ``run_dir``, once wandb-core wrote its exit record (``run.finish()``
    returns before the service has written the file out; seen with wandb 0.31)."""
    (path,) = pathlib.Path(run_dir).glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        run = _parse(path)
        if run.exit_code is not None or time.monotonic() > deadline:
            return run
        time.sleep(0.02)


def _parse(path: pathlib.Path) -> RunFile:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a .wandb file"
    run, history, metrics, exit_code = None, [], {}, None
    for payload in _chunks(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.append({k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "metric":
            metrics[record.metric.name or record.metric.glob_name] = record.metric.step_metric
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return RunFile(run, history, metrics, exit_code)
