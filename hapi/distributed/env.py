"""What the launcher told this process: environment variables, read with clear errors."""

from __future__ import annotations

import datetime
import os

DEFAULT_TIMEOUT_S = 300


class DistributedSetupError(RuntimeError):
    """The distributed environment is inconsistent or cannot be joined."""


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedSetupError(
            f"The environment variable {name}={value!r} is not an integer. Launch with "
            "torchrun or hapi.spawn, which set it, or fix the value."
        ) from None



def timeout() -> datetime.timedelta:
    """How long a collective may wait for the others (``HAPI_DIST_TIMEOUT``, seconds)."""
    return datetime.timedelta(seconds=env_int("HAPI_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
