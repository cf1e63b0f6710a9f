"""After torchrun restarts its workers, the new processes meet in a store no earlier attempt used.

The agents' store outlives the workers, so it still holds what the failed attempt
published. The real restarts are in test_resume.py; here the two steps of the
meeting run in one process, against every kind of stale publication.
"""

from __future__ import annotations

import datetime
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
    joiner = threading.Thread(target=lambda: joined.append(store._join_published_store(agent, 2, TIMEOUT)))
    joiner.start()
    time.sleep(2.5)
    assert not joined  # a dead address is no answer: still waiting
    # ...and a live store on that attempt's address (the port reused) holds another token.
    reused = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    reused.set(store._TOKEN_KEY, "someone-else")
    agent.set(store._PUBLISHED_KEY, f"127.0.0.1 {reused.port} earlier-token")
    time.sleep(2.5)
    assert not joined
    rank_0_store = store._publish_new_store(agent, "127.0.0.1", 2, TIMEOUT)
    joiner.join(timeout=30)
    assert joined, "rank 1 never joined the store rank 0 published"
    rank_0_store.set("from rank 0", "hello")
    assert joined[0].get("from rank 0") == b"hello"  # the very store rank 0 hosts
