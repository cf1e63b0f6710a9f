"""Several processes writing one checkpoint path while others read it: never a half-written file.

Each writer saves, again and again, a state whose every value is one number
(its own, and the save's); each reader loads the path as fast as it can. A
file whose values disagree, or that does not load, was half-written or mixed
from two saves. Writers use both ways of saving (in the background, as
BackupAndRestore does, and blocking), so two jobs backing up to one directory
are covered. The directory must end with the live file alone: no temporary or
spare left.

Run as a script, this file is one writer or reader (``python test_many_writers.py
write|read PATH ...``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

WRITERS, SAVES, READERS = 3, 20, 2
ELEMENTS = 500_000  # 2 MB: long enough for writes to overlap


def _write(path: str, ident: int) -> dict:
    import torch

    from hapi import checkpoint

    failed = []
    for index in range(SAVES):
        value = float(ident * 1000 + index)
        state = {"format": "torch-hapi", "version": 1, "step": value}
        state["network"] = {"w": torch.full((ELEMENTS,), value)}
        try:
            checkpoint.save_state(path, state, wait=index % 4 == 3)
        except Exception as error:  # noqa: BLE001 -- counted and reported
            failed.append(f"{type(error).__name__}: {error}")
    try:
        checkpoint.wait_for_writes()
    except Exception as error:  # noqa: BLE001 -- counted and reported
        failed.append(f"{type(error).__name__}: {error}")
    return {"failed": failed}


def _read(path: str, stop: str) -> dict:
    from hapi import checkpoint

    reads, bad = 0, []
    print("ready", flush=True)
    while not os.path.exists(stop):
        time.sleep(0.01)  # else each reader takes a whole core from the writers and the suite
        try:
            _, state = checkpoint.load_state(path)
        except FileNotFoundError:
            continue  # before the first save
        except Exception as error:  # noqa: BLE001 -- a file that does not load: reported
            bad.append(f"{type(error).__name__}: {str(error)[:200]}")
            continue
        reads += 1
        values = state["network"]["w"]
        if not bool((values == state["step"]).all()):
            bad.append(f"step {state['step']} holds values {values.unique().tolist()[:4]}")
    return {"reads": reads, "bad": bad}


def _start(*args: str) -> subprocess.Popen:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True, env=environment
    )


def test_several_processes_writing_one_path_never_show_a_reader_a_half_written_file(tmp_path):
    path, stop = str(tmp_path / "backup"), str(tmp_path.parent / f"{tmp_path.name}.stop")
    readers = [_start("read", path + ".pt", stop) for _ in range(READERS)]
    for reader in readers:
        assert reader.stdout.readline().strip() == "ready"
    started = time.monotonic()
    writers = [_start("write", path, str(ident)) for ident in range(1, WRITERS + 1)]
    written = [
        json.loads(writer.communicate(timeout=300)[0].splitlines()[-1]) for writer in writers
    ]
    open(stop, "w").close()
    read = [json.loads(reader.communicate(timeout=60)[0].splitlines()[-1]) for reader in readers]
    print(f"{WRITERS}x{SAVES} saves in {time.monotonic() - started:.1f} s; reads: {read}")
    assert [w["failed"] for w in written] == [[]] * WRITERS
    assert [r["bad"] for r in read] == [[]] * READERS
    assert sum(r["reads"] for r in read) >= 20  # the readers did read while writers wrote
    assert os.listdir(tmp_path) == ["backup.pt"]  # no temporary, spare or link left


if __name__ == "__main__":
    role, target, argument = sys.argv[1:4]
    result = _write(target, int(argument)) if role == "write" else _read(target, argument)
    print(json.dumps(result), flush=True)


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    """A writer killed mid-write leaves its temporary; the next write of that path on this
    machine removes it (its process is gone), and leaves a live writer's and another
    machine's alone, so restarts after crashes do not pile up copies of the checkpoint."""
    import torch

    from hapi import checkpoint
    from hapi.checkpoint import files

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = "backup.pt"
    orphan = tmp_path / f".{name}.{files._HOST}.{dead.pid}.0123456789ab.tmp"
    live = tmp_path / f".{name}.{files._HOST}.{os.getpid()}.0123456789ab.tmp"
    elsewhere = tmp_path / f".{name}.other-machine.{dead.pid}.0123456789ab.tmp"
    for temporary in (orphan, live, elsewhere):
        temporary.write_bytes(b"\0" * 1024)
    checkpoint.save_state(tmp_path / name, {"format": "torch-hapi", "w": torch.ones(3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, live.name, elsewhere.name])
