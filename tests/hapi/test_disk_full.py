"""A full disk, for real: every way torch-hapi writes a file says so, names the file, and keeps the previous one.

The disk is a 2 MB tmpfs the test mounts in a mount namespace of its own
(``unshare``: gone with the process, nothing to unmount); a model of 4 MB
does not fit on it. Last, the disk is remounted read-only. One process runs every writer in turn and reports what
each raised and what it left on the disk.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys
import textwrap

ROOT = str(pathlib.Path(__file__).resolve().parents[2])

SCRIPT = textwrap.dedent("""
    import json, os, shutil, subprocess, sys, torch
    from torch import nn
    import hapi
    from hapi.callbacks import BackupAndRestore, CSVLogger, ModelCheckpoint

    disk = sys.argv[1]
    data = torch.utils.data.TensorDataset(torch.randn(8, 1000), torch.randn(8, 1000))

    def model(width):  # width 1000: 4 MB of weights, twice the disk
        net = hapi.Model(nn.Linear(1000, width))
        net.prepare(torch.optim.SGD(net.parameters(), lr=0.1), nn.MSELoss())
        return net

    def fit(*callbacks):
        model(1000).fit(data, batch_size=4, epochs=1, verbose=0, callbacks=list(callbacks))

    def background():
        big = model(1000)
        big.save(f"{disk}/bg/ckpt", wait=False)
        big.wait_for_saves()

    def sharded(wait):
        def run():
            big = model(1000)
            big.save(f"{disk}/sharded", sharded=True, wait=wait)
            big.wait_for_saves()
        return run

    def read_only():  # the same disk, remounted read-only
        subprocess.run(["mount", "-o", "remount,ro", disk], check=True)
        model(1).save(f"{disk}/kept")

    def filled(write):  # the disk full to the last byte, for a file of a few bytes
        def run():
            with open(f"{disk}/filler", "wb", buffering=0) as handle:
                try:
                    while True:
                        handle.write(b"x" * 4096)
                except OSError:
                    pass
            try:
                write()
            finally:
                os.remove(f"{disk}/filler")
        return run

    # What each scenario finds on the disk before it runs (the previous file it must keep).
    os.makedirs(f"{disk}/bg")
    model(1).save(f"{disk}/bg/ckpt")
    model(1).save(f"{disk}/kept")
    os.makedirs(f"{disk}/csv")
    with open(f"{disk}/csv/log.csv", "w") as handle:
        handle.write("epoch\\n")
    scenarios = {
        "save into a new directory": lambda: model(1000).save(f"{disk}/new/deeper/ckpt"),
        "save over a previous file": lambda: model(1000).save(f"{disk}/kept"),
        "save(wait=False)": background,
        "ModelCheckpoint": lambda: fit(ModelCheckpoint(f"{disk}/mc")),
        "BackupAndRestore": lambda: fit(BackupAndRestore(f"{disk}/bk")),
        "CSVLogger": filled(lambda: fit(CSVLogger(f"{disk}/csv/log.csv"))),
        "save, disk full to the byte": filled(lambda: model(1).save(f"{disk}/kept")),
        "save(sharded=True)": sharded(True),
        "save(sharded=True, wait=False)": sharded(False),
        "save on a read-only disk": read_only,
    }
    def listing():
        return sorted(os.path.relpath(os.path.join(d, n), disk)
                      for d, dirs, names in os.walk(disk) for n in dirs + names)
    before = listing()
    files = {name: open(f"{disk}/{name}", "rb").read()
             for name in ("kept.pt", "bg/ckpt.pt", "csv/log.csv")}
    for name, scenario in scenarios.items():
        try:
            scenario()
            raised = None
        except BaseException as error:
            raised = {"types": [t.__name__ for t in type(error).__mro__],
                      "errno": getattr(error, "errno", None), "message": str(error)}
        print(json.dumps({"scenario": name, "raised": raised, "left": listing(),
                          "kept": [n for n, b in files.items()
                                   if open(f"{disk}/{n}", "rb").read() == b],
                          "free": shutil.disk_usage(disk).free}), flush=True)
    print(json.dumps({"before": before}))
""")


def test_a_full_disk_is_said_in_words_naming_the_file_and_nothing_is_left_behind(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    namespace = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    command = (
        f"mount -t tmpfs -o size=2m tmpfs {disk} && "
        f'exec {sys.executable} -c "$0" {disk}'  # the script as $0: no quoting to get wrong
    )
    result = subprocess.run(
        [*namespace, "sh", "-c", command, SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    *reports, read_only, first = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(reports) == 9, result.stdout
    failures = []
    for report in reports:
        raised, name = report["raised"], report["scenario"]
        message = raised and raised["message"]
        expected_type = "OSError" if name == "CSVLogger" else "CheckpointError"
        problems = [
            f"raised {raised and raised['types'][0]}, expected {expected_type}"
            * (not raised or expected_type not in raised["types"]),
            "not an OSError with errno ENOSPC"
            * (not raised or "OSError" not in raised["types"] or raised["errno"] != errno.ENOSPC),
            "no word of a full disk"
            * (not message or ("disk is full" not in message and "No space left" not in message)),
            "names no file" * (not message or str(disk) not in message),
            f"left {sorted(set(report['left']) - set(first['before']))}"
            * (set(report["left"]) != set(first["before"])),
            f"the previous files changed: only {report['kept']} kept" * (len(report["kept"]) != 3),
        ]
        if any(problems):
            failures.append((name, [p for p in problems if p], message))
    assert not failures, (f"{len(failures)} of {len(reports)} failed", failures)
    raised = read_only["raised"]
    assert raised["errno"] == errno.EROFS and {"CheckpointError", "OSError"} <= set(raised["types"])
    assert raised["message"].startswith(
        f"Could not write the checkpoint '{disk}/kept.pt': the file system is read-only"
    )
    free = [report["free"] for report in reports[:-1]]
    assert free == [free[0]] * len(free) and free[0] > 1_000_000  # no space held by leftovers
