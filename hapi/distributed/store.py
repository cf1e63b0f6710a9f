"""A process-group store that no earlier torchrun attempt has written to."""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid
from typing import Any

import torch.distributed as dist

from hapi.distributed.env import DistributedSetupError, env_int


def restart_safe_store(timeout: datetime.timedelta) -> dict[str, Any]:
    """A store no earlier torchrun attempt has written to, when workers share the agent's.

    Under ``torchrun`` (c10d rendezvous) the workers' ``MASTER_PORT`` is a
    store the agents keep for the whole job, so after ``--max-restarts``
    restarts the workers it still holds the failed attempt's keys, each dead
    rank's Gloo address among them: a new rank could read one and fail with
    "Connection refused". ``TORCHELASTIC_RESTART_COUNT`` cannot name the
    attempt, because each agent counts its own restarts -- on several
    machines, a node restarted only because another node failed keeps its
    count (pytorch/pytorch#135712), and its workers would wait in another
    namespace until the timeout. So rank 0 hosts a fresh store for this
    attempt and publishes its address with a random token; the others
    connect only to a live store holding that token, which a stale
    publication (a dead rank 0, or its port reused) never does.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    agent_host, agent_port = os.environ["MASTER_ADDR"], env_int("MASTER_PORT", 0)
    this_rank, processes = env_int("RANK", 0), env_int("WORLD_SIZE", 1)  # the group is not made yet
    agent_store = dist.TCPStore(agent_host, agent_port, world_size=processes, is_master=False,
                                timeout=timeout)
    if this_rank == 0:
        store = _publish_new_store(agent_store, _address_seen_from(agent_host, agent_port), processes, timeout)
    else:
        store = _join_published_store(agent_store, processes, timeout)
    return {"store": store, "rank": this_rank, "world_size": processes}


_PUBLISHED_KEY = "hapi/process_group_store"
_TOKEN_KEY = "hapi/token"


def _publish_new_store(agent_store: dist.Store, host: str, processes: int,
                       timeout: datetime.timedelta) -> dist.Store:
    """Rank 0: a store on a free port, its address and token published in ``agent_store``."""
    store = dist.TCPStore(host, 0, world_size=processes, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    token = uuid.uuid4().hex
    store.set(_TOKEN_KEY, token)
    agent_store.set(_PUBLISHED_KEY, f"{host} {store.port} {token}")
    return store


def _address_seen_from(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what the other machines can reach).

    A UDP ``connect`` picks the route and sends nothing.
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _join_published_store(agent_store: dist.Store, processes: int,
                          timeout: datetime.timedelta) -> dist.Store:
    """Rank 0's store for this attempt, once its publication is this attempt's."""
    deadline = time.monotonic() + timeout.total_seconds()
    probe_timeout = datetime.timedelta(seconds=2)
    while True:
        host, port, token = agent_store.get(_PUBLISHED_KEY).decode().split()
        try:
            store = dist.TCPStore(host, int(port), world_size=processes, is_master=False,
                                  timeout=probe_timeout)
            if store.get(_TOKEN_KEY).decode() == token:
                store.set_timeout(timeout)
                return store
        except (RuntimeError, ValueError):  # torch's store errors (DistNetworkError, ...) are RuntimeErrors
            pass  # an earlier attempt's publication: its rank 0 is gone
        if time.monotonic() > deadline:
            raise DistributedSetupError(
                f"Rank 0 did not publish a reachable store within {timeout.total_seconds():.0f} s "
                f"(last published: {host}:{port}). Check that this machine can reach rank 0's "
                "machine on any port, or raise HAPI_DIST_TIMEOUT.")
        time.sleep(0.2)


