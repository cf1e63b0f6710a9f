"""A process-group store that no earlier torchrun attempt has written to, at an address the others reach."""

from __future__ import annotations

import contextlib
import ctypes.util
import datetime
import ipaddress
import os
import socket
import sys
import time
from typing import Any

import torch.distributed as dist

from hapi.distributed.env import DistributedSetupError, env_int


def restart_safe_store(timeout: datetime.timedelta) -> dict[str, Any]:
    """A store no earlier torchrun attempt has written to, when workers share the agent's.

    Under ``torchrun`` (c10d rendezvous) the workers' ``MASTER_PORT`` is a
    store the agents keep for the whole job, so after ``--max-restarts``
    restarts the workers it still holds the failed attempt's keys, each dead
    rank's Gloo address among them: a new rank could read one and fail with
    "Connection refused". Still so in torch 2.13: two workers under
    ``torchrun --standalone --max-restarts=1``, one killed after
    ``init_process_group``, failed the restarted attempt's Gloo connect in 2 of 3 runs
    (3 of 3 when one worker starts 2 s late). ``TORCHELASTIC_RESTART_COUNT`` cannot name the
    attempt, because each agent counts its own restarts -- on several
    machines, a node restarted only because another node failed keeps its
    count (pytorch/pytorch#135712), and its workers would wait in another
    namespace until the timeout. So rank 0 hosts a fresh store for this
    attempt and publishes its address with a random token; the others
    connect only to a live store holding that token, which a stale
    publication (a dead rank 0, or its port reused) never does.

    When the processes span machines, Gloo is also told which interface to
    listen on where its own choice would be loopback (see
    :func:`_bind_gloo_where_others_reach`).
    """
    agent_host, agent_port = os.environ["MASTER_ADDR"], env_int("MASTER_PORT", 0)
    this_rank, processes = env_int("RANK", 0), env_int("WORLD_SIZE", 1)  # the group is not made yet
    spans_machines = env_int("LOCAL_WORLD_SIZE", processes) < processes
    if spans_machines:
        _bind_gloo_where_others_reach(agent_host, agent_port)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    agent_store = dist.TCPStore(agent_host, agent_port, world_size=processes, timeout=timeout)
    if this_rank == 0:
        hosts = _addresses_others_reach(agent_host, agent_port, spans_machines)
        store = _publish_new_store(agent_store, hosts, timeout)
    else:
        store = _join_published_store(agent_store, processes, timeout)
    _attempt_store[:] = [(store, this_rank, processes)]
    return {"store": store, "rank": this_rank, "world_size": processes}


_PUBLISHED_KEY = "hapi/process_group_store"
_TOKEN_KEY = "hapi/token"
_attempt_store: list[tuple[dist.Store, int, int]] = []  # [(store, this rank, processes)] once made


def leave_attempt_store(limit: datetime.timedelta) -> None:
    """After the process group is destroyed: rank 0 hosts the attempt's store until every
    other rank says it is done with the group (bounded by ``limit``).

    The store lives in rank 0's process (see :func:`restart_safe_store`), so
    rank 0 exiting while another rank still tears its group down takes the
    store from under it: that rank could abort at exit after a finished run.
    """
    if not _attempt_store:
        return
    store, this_rank, processes = _attempt_store.pop()
    # A peer that died, or rank 0 already gone (torch's store errors): nothing to wait for.
    with contextlib.suppress(RuntimeError, ValueError):
        if this_rank == 0:
            store.wait([f"hapi/left/{other}" for other in range(1, processes)], limit)
        else:
            store.set(f"hapi/left/{this_rank}", "done")


def _publish_new_store(
    agent_store: dist.Store, hosts: list[str], timeout: datetime.timedelta
) -> dist.Store:
    """Rank 0: a store on a free port; its addresses, port and token published in ``agent_store``.

    The store listens on every address of this machine, so each of ``hosts`` reaches it.
    """
    store = dist.TCPStore(hosts[0], 0, is_master=True, timeout=timeout, wait_for_workers=False)
    token = os.urandom(16).hex()
    store.set(_TOKEN_KEY, token)
    agent_store.set(_PUBLISHED_KEY, f"{','.join(hosts)} {store.port} {token}")
    return store


def _addresses_others_reach(agent_host: str, agent_port: int, spans_machines: bool) -> list[str]:
    """This machine's addresses where the other processes can reach it, best first.

    The address on the route to the agents' store is the answer unless it is
    a loopback address: ``MASTER_ADDR`` then names this very machine, and
    that name resolves to loopback here (Debian and Ubuntu write ``127.0.1.1
    <hostname>`` in /etc/hosts), while another machine resolves it to a real
    address -- and would read a loopback address as itself. So when the
    processes span machines, a loopback address gives way to all of this
    machine's other addresses (the joiners try each; the token tells them
    rank 0's store). A machine with loopback alone cannot be reached from
    another one: all the processes are on it, and loopback serves.
    """
    seen = _address_seen_from(agent_host, agent_port)
    if not spans_machines or not _is_loopback(seen):
        return [seen]
    others = dict.fromkeys(a for _, a in _machine_addresses() if not _is_loopback(a))  # in order
    return sorted(others, key=lambda a: ipaddress.ip_address(a).version) or [seen]  # IPv4 first


def _address_seen_from(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what the other machines can reach).

    A UDP ``connect`` picks the route and sends nothing.
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _join_published_store(
    agent_store: dist.Store, processes: int, timeout: datetime.timedelta
) -> dist.Store:
    """Rank 0's store for this attempt, once its publication is this attempt's.

    The publication may name several addresses of rank 0's machine: the
    first one where a store answers with the published token is rank 0's.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    probe_timeout = datetime.timedelta(seconds=2)
    while True:
        hosts, port, token = agent_store.get(_PUBLISHED_KEY).decode().split()
        for host in hosts.split(","):
            # An earlier attempt's publication (its rank 0 is gone), or an address not reached
            # from here: a plain socket finds out quietly, where a store client that cannot
            # connect logs a C++ stack trace. Store errors (RuntimeErrors): a port now used
            # by another program.
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                socket.create_connection((host, int(port)), probe_timeout.total_seconds()).close()
                store = dist.TCPStore(host, int(port), world_size=processes, timeout=probe_timeout)
                if store.get(_TOKEN_KEY).decode() == token:
                    store.set_timeout(timeout)
                    return store
        if time.monotonic() > deadline:
            raise DistributedSetupError(
                f"Rank 0 did not publish a reachable store within {timeout.total_seconds():.0f} s "
                f"(last published: port {port} at {hosts.replace(',', ', ')}). Check that this machine "
                "can reach rank 0's machine on any port, or raise HAPI_DIST_TIMEOUT."
            )
        time.sleep(0.2)


def _bind_gloo_where_others_reach(agent_host: str, agent_port: int) -> None:
    """Set ``GLOO_SOCKET_IFNAME`` when Gloo would listen on loopback, unreachable from other machines.

    Unless told an interface, Gloo listens on the address this machine's
    name resolves to -- ``127.0.1.1`` on Debian and Ubuntu -- and publishes
    it to the other ranks, which then connect to themselves. The interface
    chosen holds the first address of :func:`_addresses_others_reach`. A
    ``GLOO_SOCKET_IFNAME`` the user set is kept.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME") or not _name_resolves_to_loopback(socket.gethostname()):
        return
    try:
        address = _addresses_others_reach(agent_host, agent_port, spans_machines=True)[0]
    except OSError:  # MASTER_ADDR does not resolve: joining the store will say so
        return
    interface = {found: name for name, found in _machine_addresses()}.get(address)
    if interface is not None and not _is_loopback(address):  # loopback alone: nothing better
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def _name_resolves_to_loopback(name: str) -> bool:
    """True when ``name``'s first address is loopback, or when it resolves to nothing.

    Gloo's own choice, for the machine's name: that address, or loopback.
    """
    try:
        return _is_loopback(socket.getaddrinfo(name, None)[0][4][0])
    except (OSError, IndexError):
        return True


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


class _InterfaceAddress(ctypes.Structure):
    """The leading fields of C's ``struct ifaddrs`` (only read, never allocated here)."""


_InterfaceAddress._fields_ = [
    ("next", ctypes.POINTER(_InterfaceAddress)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("address", ctypes.c_void_p),
]


def _machine_addresses() -> list[tuple[str, str]]:
    """``(interface, address)`` for each IPv4 and IPv6 address of this machine's interfaces that are up.

    IPv6 link-local addresses are left out: they mean nothing without an
    interface name. Read with the C library's ``getifaddrs``; where there is
    none (Windows), the addresses this machine's name resolves to.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        getifaddrs, freeifaddrs = libc.getifaddrs, libc.freeifaddrs
    except (OSError, AttributeError, TypeError):
        return [("", info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)]
    head = ctypes.POINTER(_InterfaceAddress)()
    if getifaddrs(ctypes.byref(head)) != 0:
        return []
    found = []
    entry = head
    while entry:
        if entry.contents.address and entry.contents.flags & 0x1:  # IFF_UP
            address = _sockaddr_text(entry.contents.address)
            if address and not (":" in address and ipaddress.ip_address(address).is_link_local):
                found.append((entry.contents.name.decode(errors="replace"), address))
        entry = entry.contents.next
    freeifaddrs(head)
    return found


def _sockaddr_text(sockaddr: int) -> str | None:
    """The address in the IPv4 or IPv6 ``struct sockaddr`` at ``sockaddr`` (``None`` for other families)."""
    if sys.platform.startswith("linux"):
        family = ctypes.c_ushort.from_address(sockaddr).value
    else:  # the BSDs and macOS: a length byte, then a one-byte family
        family = ctypes.c_ubyte.from_address(sockaddr + 1).value
    # Where the address lies in the struct, and its length.
    offset, size = {socket.AF_INET: (4, 4), socket.AF_INET6: (8, 16)}.get(family, (0, 0))
    return socket.inet_ntop(family, ctypes.string_at(sockaddr + offset, size)) if size else None
