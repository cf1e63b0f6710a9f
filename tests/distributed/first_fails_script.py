"""Rank 0's main_process_first() block raises; each rank writes what it saw, and how soon."""

import json
import sys
import time

from hapi import distributed

out = sys.argv[1]
distributed.init()
started = time.monotonic()
try:
    with distributed.main_process_first():
        if distributed.rank() == 0:
            raise OSError("download failed: no network")
    seen = "ran"
except Exception as error:  # noqa: BLE001 -- the test reads what each rank got
    seen = f"{type(error).__name__}: {error}"
with open(f"{out}/first.rank{distributed.rank()}.json", "w") as handle:
    json.dump({"seen": seen, "seconds": time.monotonic() - started}, handle)
