"""After torchrun restarts its workers, the new processes meet in a store no earlier attempt used.

The agents' store outlives the workers, so it still holds what the failed attempt
published. The real restarts are in test_resume.py and test_two_hosts.py; here the
two steps of the meeting run in one process, against every kind of stale publication,
and the choice of the addresses rank 0 publishes is checked on made-up machines.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import threading
import time

import torch.distributed as dist

from hapi.distributed import store

TIMEOUT = datetime.timedelta(seconds=60)


def test_other_ranks_wait_past_stale_publications_for_this_attempts_rank_0(free_port):
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # An earlier attempt's rank 0 published a store that died with it (nothing listens there)...
    agent.set(store._PUBLISHED_KEY, f"127.0.0.1 {free_port} earlier-token")
    joined: list = []
    joiner = threading.Thread(
        target=lambda: joined.append(store._join_published_store(agent, 2, TIMEOUT))
    )
    joiner.start()
    time.sleep(2.5)
    assert not joined  # a dead address is no answer: still waiting
    # ...and a live store on that attempt's address (the port reused) holds another token.
    reused = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    reused.set(store._TOKEN_KEY, "someone-else")
    agent.set(store._PUBLISHED_KEY, f"127.0.0.1 {reused.port} earlier-token")
    time.sleep(2.5)
    assert not joined
    rank_0_store = store._publish_new_store(agent, ["127.0.0.1"], TIMEOUT)
    joiner.join(timeout=30)
    assert joined, "rank 1 never joined the store rank 0 published"
    rank_0_store.set("from rank 0", "hello")
    assert joined[0].get("from rank 0") == b"hello"  # the very store rank 0 hosts


def test_the_joiner_tries_each_published_address_until_one_holds_the_token():
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    rank_0_store = store._publish_new_store(agent, ["127.0.0.1"], TIMEOUT)
    _, port, token = agent.get(store._PUBLISHED_KEY).decode().split()
    # Rank 0's machine has several addresses; the first one published is not reached from here.
    agent.set(store._PUBLISHED_KEY, f"192.0.2.77,127.0.0.1 {port} {token}")
    joined = store._join_published_store(agent, 2, TIMEOUT)
    rank_0_store.set("from rank 0", "hello")
    assert joined.get("from rank 0") == b"hello"


MACHINE = [
    ("lo", "127.0.0.1"),
    ("eth0", "10.1.2.3"),
    ("lo", "::1"),
    ("eth0", "fd00::5"),
    ("eth1", "192.168.7.9"),
]


def _machine(monkeypatch, seen, addresses=MACHINE):
    monkeypatch.setattr(store, "_address_seen_from", lambda host, port: seen)
    monkeypatch.setattr(store, "_machine_addresses", lambda: list(addresses))


def test_the_address_on_the_route_to_the_agents_store_is_published(monkeypatch):
    _machine(monkeypatch, "10.1.2.3")
    assert store._addresses_others_reach("master", 1, spans_machines=True) == ["10.1.2.3"]
    _machine(monkeypatch, "127.0.0.1")
    # All processes on this machine: loopback reaches them all.
    assert store._addresses_others_reach("localhost", 1, spans_machines=False) == ["127.0.0.1"]


def test_a_loopback_route_across_machines_publishes_every_other_address(monkeypatch):
    # MASTER_ADDR is this machine's name, which /etc/hosts maps to 127.0.1.1 (Debian, Ubuntu):
    # another machine would read a loopback address as itself.
    _machine(monkeypatch, "127.0.1.1")
    assert store._addresses_others_reach("hosta", 1, spans_machines=True) == [
        "10.1.2.3",
        "192.168.7.9",
        "fd00::5",
    ]
    # A machine with loopback alone cannot be reached from another: all processes are on it.
    _machine(monkeypatch, "127.0.1.1", [("lo", "127.0.0.1"), ("lo", "::1")])
    assert store._addresses_others_reach("hosta", 1, spans_machines=True) == ["127.0.1.1"]


def test_gloo_listens_where_the_others_reach_when_the_hostname_is_loopback(monkeypatch):
    # The code under test writes os.environ: a private copy keeps what it sets out of
    # later tests (their child processes would inherit GLOO_SOCKET_IFNAME=eth0).
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(store, "_name_resolves_to_loopback", lambda name: False)
    _machine(monkeypatch, "127.0.1.1")
    store._bind_gloo_where_others_reach("hosta", 1)
    assert (
        "GLOO_SOCKET_IFNAME" not in os.environ
    )  # the hostname is reachable: Gloo's own choice serves
    monkeypatch.setattr(store, "_name_resolves_to_loopback", lambda name: True)
    store._bind_gloo_where_others_reach("hosta", 1)
    assert (
        os.environ["GLOO_SOCKET_IFNAME"] == "eth0"
    )  # rank 0's machine: the first published address
    _machine(monkeypatch, "192.168.7.9")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    store._bind_gloo_where_others_reach("hosta", 1)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth1"  # another machine: the route to rank 0's
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")
    store._bind_gloo_where_others_reach("hosta", 1)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine"  # the user's choice is kept
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    _machine(monkeypatch, "127.0.1.1", [("lo", "127.0.0.1")])
    store._bind_gloo_where_others_reach("hosta", 1)
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # loopback alone: nothing better to choose


def test_this_machines_addresses_are_read_from_its_interfaces():
    found = store._machine_addresses()
    assert any(store._is_loopback(address) for _, address in found)
    for interface, address in found:
        parsed = ipaddress.ip_address(address)  # a well-formed IPv4 or IPv6 address
        assert interface and not (parsed.version == 6 and parsed.is_link_local)
