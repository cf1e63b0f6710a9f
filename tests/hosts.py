"""Two Linux hosts on one machine, for tests that need more than one host.

Each host is a network namespace with its own address on a veth pair that
joins the two, its own hostname (a UTS namespace made for each command) and
its own /etc/hosts (``ip netns exec`` mounts /etc/netns/<namespace>/hosts over
/etc/hosts). As on Debian and Ubuntu, a host's /etc/hosts maps its own name to
127.0.1.1, and the other host's name to that host's veth address. Traffic
between them never leaves the namespaces made here.

Needs root, iproute2's ``ip`` and util-linux's ``unshare``; :func:`two_hosts`
skips the test, saying why, where any of them is missing or the kernel refuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import pathlib
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Iterator, Sequence

import pytest


@dataclasses.dataclass(frozen=True)
class Host:
    name: str  # its hostname, resolved to 127.0.1.1 on itself and to `address` on the other host
    namespace: str
    interface: str  # its end of the veth pair
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on this host: its network namespace and /etc, a new UTS namespace with its name."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespace,
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.name,
            *argv,
        ]


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _unused_subnet() -> ipaddress.IPv4Network:
    """A random private /24 that no address or route of this machine overlaps."""
    taken = []
    for listing in (_ip("-o", "-4", "addr").stdout, _ip("-4", "route").stdout):
        for word in listing.split():
            with contextlib.suppress(ValueError):
                taken.append(ipaddress.ip_network(word, strict=False))
    for _ in range(100):
        subnet = ipaddress.ip_network(f"10.{random.randint(64, 250)}.{random.randint(0, 255)}.0/24")
        if not any(subnet.overlaps(network) for network in taken):
            return subnet
    raise RuntimeError(f"no free 10.x.y.0/24 subnet: this machine uses {taken}")


def _refused(step: str, result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        pytest.skip(
            f"cannot make two hosts on this machine: `{step}` failed "
            f"({result.returncode}): {(result.stderr or result.stdout).strip()}"
        )


@contextlib.contextmanager
def two_hosts(names: tuple[str, str] = ("hosta", "hostb")) -> Iterator[tuple[Host, Host]]:
    """Make two hosts named ``names`` joined by a veth pair; remove everything on exit, even after a failure."""
    if os.geteuid() != 0:
        pytest.skip(
            "two hosts need network namespaces, which only root can make (run the tests as root)"
        )
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"two hosts need `{tool}` (iproute2 / util-linux), which is not installed")
    made_etc_netns = not pathlib.Path("/etc/netns").exists()
    suffix = secrets.token_hex(3)
    subnet = _unused_subnet()
    hosts = tuple(
        Host(name, f"hapi-{name}-{suffix}", f"hv{name[-1]}-{suffix}", str(subnet[1 + i]))
        for i, name in enumerate(names)
    )
    try:
        for host in hosts:
            _refused(f"ip netns add {host.namespace}", _ip("netns", "add", host.namespace))
        a, b = hosts
        # Both ends are created inside their namespaces: nothing appears on this machine's own network.
        _refused(
            "ip link add ... type veth",
            _ip(
                "link",
                "add",
                a.interface,
                "netns",
                a.namespace,
                "type",
                "veth",
                "peer",
                "name",
                b.interface,
                "netns",
                b.namespace,
            ),
        )
        for host, other in ((a, b), (b, a)):
            _refused(
                "ip addr add",
                _ip(
                    "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface
                ),
            )
            for device in ("lo", host.interface):
                _refused(
                    f"ip link set {device} up",
                    _ip("-n", host.namespace, "link", "set", device, "up"),
                )
            etc = pathlib.Path("/etc/netns") / host.namespace
            etc.mkdir(parents=True)
            (etc / "hosts").write_text(
                f"127.0.0.1 localhost\n127.0.1.1 {host.name}\n{other.address} {other.name}\n"
            )
        for host in hosts:
            named = subprocess.run(
                host.command(["hostname"]), capture_output=True, text=True, timeout=30
            )
            _refused(f"unshare --uts sh -c 'hostname {host.name}'", named)
            if named.stdout.strip() != host.name:
                pytest.skip(
                    f"cannot make two hosts on this machine: a new UTS namespace kept the hostname "
                    f"{named.stdout.strip()!r} instead of {host.name!r}"
                )
        yield hosts
    finally:
        for host in hosts:
            _remove(host)
        if made_etc_netns:
            with contextlib.suppress(OSError):  # not empty: another test's hosts are there
                pathlib.Path("/etc/netns").rmdir()


def _remove(host: Host) -> None:
    """Stop what still runs on ``host``, then delete its namespace (and with it the veth pair) and its /etc."""
    pids = _ip("netns", "pids", host.namespace).stdout.split()
    for pid in pids:  # only processes in a namespace made here: this test's own
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    if pids:
        time.sleep(0.2)
    _ip("netns", "delete", host.namespace)
    _ip(
        "link", "delete", host.interface
    )  # already gone with its namespace, unless it never got there
    shutil.rmtree(pathlib.Path("/etc/netns") / host.namespace, ignore_errors=True)


def run_on_hosts(
    jobs: Sequence[tuple[Host, Sequence[str]]], timeout: float, env: dict[str, str]
) -> list[subprocess.CompletedProcess]:
    """Run each ``(host, argv)`` at once, each in its own session; wait for all of them.

    Outputs (stdout and stderr together) go through files, so a chatty job
    never blocks on a full pipe while another waits for it. On timeout every
    job's process group is killed and AssertionError shows the outputs.
    """
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        outputs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in jobs]
        processes = [
            subprocess.Popen(
                host.command(argv),
                stdout=output,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                start_new_session=True,
            )
            for (host, argv), output in zip(jobs, outputs)
        ]
        timed_out = False
        try:
            for process in processes:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            for process in processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        texts = []
        for output in outputs:
            output.seek(0)
            texts.append(output.read())
    if timed_out:
        shown = "\n".join(
            f"--- {host.name}:\n{text[-4000:]}" for (host, _), text in zip(jobs, texts)
        )
        raise AssertionError(
            f"jobs on {[host.name for host, _ in jobs]} did not finish in {timeout} s:\n{shown}"
        )
    return [
        subprocess.CompletedProcess(host.command(argv), process.returncode, text, "")
        for (host, argv), process, text in zip(jobs, processes, texts)
    ]
