"""A process group for collectives issued from a background thread (a checkpoint written beside training).

torch runs a group's collectives in the order each process issues them. A
background thread issues its own at any time, so on the default group they
would interleave with training's and pair up wrongly across processes; on a
group of their own they never meet training's.
"""

from __future__ import annotations

import torch.distributed as dist

from hapi.distributed.env import timeout
from hapi.distributed.group import world_size

_group: dist.ProcessGroup | None = None


def background_group() -> dist.ProcessGroup | None:
    """A Gloo group of its own for saves running in the background; ``None`` on one process.

    Created by every process at its first background save, which they make
    together (creating a group is itself a collective).
    """
    global _group
    if world_size() == 1:
        return None
    if _group is None:
        _group = dist.new_group(backend="gloo", timeout=timeout())
    return _group
