"""Ctrl-C at any moment of a run that saves in the background: the last save that returned is on disk.

One driver process imports torch and torch-hapi once, then forks one child
per moment; each child trains, saving with ``wait=False`` after every batch,
and ends its script normally unless interrupted. The first two run untouched
and time their training (the shorter counts: a busy machine slows either); the driver sends each other SIGINT (once, or twice
in quick succession) at a moment spread over that time and a little after:
during a step, while a write is awaited, while the script's end waits for
the last write.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import torch

ROOT = str(pathlib.Path(__file__).resolve().parents[2])

DRIVER = textwrap.dedent("""
    import atexit, json, os, signal, sys, time
    driver = os.getpid()
    # Run after torch-hapi's own exit hook (which waits for the last write): a child whose
    # trial number is not a multiple of 8 skips the interpreter's teardown of torch (1-2 s).
    atexit.register(lambda: os.getpid() != driver and trial % 8 and os._exit(0))
    import torch
    from torch import nn
    import hapi

    out, trials = sys.argv[1], int(sys.argv[2])
    spans = []  # how long the untouched first trials ran after their first save

    class SaveEveryBatch(hapi.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            os.write(progress, b"a%d " % self.model.step)  # asked
            self.model.save(os.path.join(directory, "ckpt"), wait=False)
            os.write(progress, b"r%d " % self.model.step)  # returned

    def run(callbacks):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 2))
        net.register_buffer("bulk", torch.zeros(4_000_000))  # 16 MB: writes take a while
        model = hapi.Model(net)
        model.prepare(torch.optim.SGD(net.parameters(), lr=0.1), nn.CrossEntropyLoss())
        data = torch.utils.data.TensorDataset(torch.randn(24, 8), torch.randint(0, 2, (24,)))
        model.fit(data, batch_size=4, epochs=1, verbose=0, callbacks=callbacks)
        return model

    run([]).save(os.path.join(out, "warm"))  # the lazy imports, before the children

    for trial in range(trials):
        directory = os.path.join(out, str(trial))
        os.makedirs(directory)
        read, progress = os.pipe()
        pid = os.fork()
        if pid == 0:  # the user's script, from here to its end
            os.close(read)
            os.dup2(os.open(os.path.join(directory, "stderr"), os.O_WRONLY | os.O_CREAT), 2)
            run([SaveEveryBatch()])
            os.write(progress, b"end ")
            break
        os.close(progress)
        events = b""
        while b"r1 " not in events:  # the moments count from the first save's return
            events += os.read(read, 65536)
        first = time.monotonic()
        if trial < 2:  # two untouched trials: how long one trains from there (the
            while b"end " not in events:  # shorter: a busy machine slows either)
                events += os.read(read, 65536)
            spans.append(time.monotonic() - first)
        else:
            time.sleep(min(spans) * 2 * trial / trials)
            for _ in range(1 + trial % 2):  # every other trial: Ctrl-C twice
                try:
                    os.kill(pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
                time.sleep(0.02)
        _, status = os.waitpid(pid, 0)
        while chunk := os.read(read, 65536):
            events += chunk
        os.close(read)
        print(json.dumps({"trial": trial, "exit": os.waitstatus_to_exitcode(status),
                          "events": events.decode().split()}), flush=True)
""")


def test_ctrl_c_at_every_moment_leaves_the_last_save_that_returned(tmp_path):
    trials = 16
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path), str(trials)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(reports) == trials
    failures, waited = [], 0
    for report in reports:
        directory = tmp_path / str(report["trial"])
        stderr = (directory / "stderr").read_text()
        waited += "being written in the background" in stderr
        asked = [int(e[1:]) for e in report["events"] if e.startswith("a")]
        returned = [int(e[1:]) for e in report["events"] if e.startswith("r")]
        left = sorted(p.name for p in directory.iterdir()) if returned else []
        saved = (
            torch.load(directory / "ckpt.pt", weights_only=True)["step"]
            if "ckpt.pt" in left
            else None
        )
        problem = []
        if report["exit"] not in (0, -signal.SIGINT) or "terminate called" in stderr:
            problem.append(f"exit {report['exit']}")
        if returned and not (saved is not None and returned[-1] <= saved <= asked[-1]):
            problem.append(f"file holds step {saved}; the last save that returned: {returned[-1]}")
        if set(left) - {"ckpt.pt", ".ckpt.pt.spare", "stderr"}:
            problem.append(f"left behind: {left}")
        if problem:
            failures.append((report["trial"], problem, stderr[-300:]))
    assert not failures, (f"{len(failures)} of {len(reports)} failed", failures)
    # The moment that matters was reached: Ctrl-C while a write was awaited.
    assert waited >= 3, [r["exit"] for r in reports]
