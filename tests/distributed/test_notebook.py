"""torch-hapi in a real Jupyter notebook: built with nbformat, run by nbclient on an ipykernel.

* ``hapi.spawn(train, nprocs=2)`` with ``train`` defined in the notebook: both ranks train (the
  processes are forked, as ``__main__`` has no file), their figures equal a one-process run with
  the same global batch, no cell shows an error, and the kernel's signal handlers are the ones
  it had before. A child's error is its own; ``log_dir`` gets each process's prints.
* ``verbose=1`` in the notebook draws tqdm's widget (a display, not one line per ``log_freq``);
  rank 0 of the forked processes draws one text bar, which the kernel forwards.
* ``python -c`` (no file either) forks too, and Ctrl-C stops the processes with a
  ``KeyboardInterrupt``.
"""

from __future__ import annotations

import json
import pathlib
import sys
import types
import warnings
from typing import Any

import pytest
from dist_helpers import child_env, run_bounded

import callbacks.progbar
import hapi
from callbacks import ProgBarLogger

REPO = pathlib.Path(__file__).resolve().parents[2]
WIDGET = "application/vnd.jupyter.widget-view+json"

SETUP = """\
import json, os, signal
import torch
from torch import nn
import hapi

handlers = {number: signal.getsignal(number) for number in signal.valid_signals()}
"""

TRAIN = """\
def train(batch_size, verbose=0):
    torch.manual_seed(0)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    y = x[:, :3].argmax(dim=1)
    model = hapi.Model(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)))
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    history = model.fit((x, y), batch_size=batch_size, epochs=2, shuffle=False, verbose=verbose)
    rank = os.environ.get("RANK", "alone")
    with open(f"figures.{rank}.json", "w") as handle:
        json.dump({"history": history.history, "pid": os.getpid()}, handle)
    return rank
"""

FAILING = """\
def fails(how):
    if os.environ["RANK"] == "1":
        raise ValueError("boom in the notebook") if how == "raise" else os._exit(3)
    __import__("time").sleep(60)  # the launcher stops the other process

for how in ("raise", "exit"):
    try:
        hapi.spawn(fails, args=(how,), nprocs=2)
    except hapi.launch.SpawnedProcessError as error:
        print(f"--- {how}: {error}")
"""

LOGS = """\
def hello():
    print(f"rank {os.environ['RANK']} says hello")

hapi.spawn(hello, nprocs=2, log_dir="logs")
"""

CHECK_HANDLERS = """\
after = {number: signal.getsignal(number) for number in signal.valid_signals()}
changed = {number: after[number] for number in after if after[number] != handlers[number]}
print("handlers restored" if not changed else f"handlers changed: {changed}")
"""


def run_notebook(tmp_path: pathlib.Path, cells: list[str]) -> Any:
    """Execute ``cells`` in a fresh kernel of this venv's python, with this checkout's hapi."""
    reason = "the test extra is not installed: pip install -e '.[test]'"
    nbformat = pytest.importorskip("nbformat", reason=reason)
    pytest.importorskip("ipykernel", reason=reason)
    nbclient = pytest.importorskip("nbclient", reason=reason)
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    # A kernelspec of our own: "python3" could name another Python on this machine.
    spec = tmp_path / "kernels" / "hapi-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec.joinpath("kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "hapi test", "language": "python"})
    )
    specs = KernelSpecManager(kernel_dirs=[str(spec.parent)])
    manager = KernelManager(kernel_name="hapi-test", kernel_spec_manager=specs)
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(
        notebook, km=manager, timeout=120, resources={"metadata": {"path": str(tmp_path)}}
    )
    env = child_env(PYTHONPATH=str(REPO))
    del env["OMP_NUM_THREADS"]  # as a user's kernel: spawn shares the cores out itself
    # Under pytest (PYTEST_CURRENT_TEST) ipykernel leaves file descriptors 1 and 2 alone and its
    # sys.stdout has no fileno: the harder case for log_dir. A user's kernel captures them.
    client.execute(env=env)
    return notebook


def assert_no_stderr(cells: list[Any]) -> None:
    """nbclient raised on an error; this catches warnings and logged tracebacks."""
    for cell in cells:
        streams = [o for o in cell.outputs if o.output_type == "stream" and o.name == "stderr"]
        assert not streams, f"{cell.source}\n-> {''.join(o.text for o in streams)}"


def text(cell: Any) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream")


def test_spawn_and_the_progress_bar_in_a_notebook(tmp_path):
    notebook = run_notebook(
        tmp_path,
        [
            SETUP,
            TRAIN,
            "train(16)",  # one process, the global batch of the two below
            "print(sorted(hapi.spawn(train, args=(8, 1), nprocs=2).items()))",
            FAILING,
            LOGS,
            CHECK_HANDLERS,
            "train(16, verbose=1)",
        ],
    )
    spawned, failed, logs, handlers, widget = notebook.cells[3:8]
    # torch's launcher logs a failure on stderr, as under a script: only that cell has any.
    assert_no_stderr([cell for cell in notebook.cells if cell is not failed])
    assert "[(0, '0'), (1, '1')]" in text(spawned)  # both ranks ran fn and returned
    alone = json.loads((tmp_path / "figures.alone.json").read_text())
    ranks = [json.loads((tmp_path / f"figures.{r}.json").read_text()) for r in (0, 1)]
    assert len({alone["pid"], ranks[0]["pid"], ranks[1]["pid"]}) == 3  # two new processes
    for rank in ranks:
        assert rank["history"].keys() == alone["history"].keys()
        for name, values in alone["history"].items():
            assert rank["history"][name] == pytest.approx(values, rel=1e-5), name
    # A child's own error, and no advice about scripts (nothing was imported).
    raised, exited = text(failed).split("--- exit: ")
    assert "Process 1 of 2 started by hapi.spawn raised an error" in raised
    assert "ValueError: boom in the notebook" in raised
    assert "Process 1 of 2 started by hapi.spawn died with exit code 3" in exited
    assert "__main__" not in text(failed) and "Can't get attribute" not in text(failed)
    # log_dir holds each process's prints (not the kernel's stream); rank 0's also show.
    for rank in (0, 1):
        log = (tmp_path / "logs" / f"workerlog.{rank}").read_text()
        assert log == f"rank {rank} says hello\n", log
    assert "rank 0 says hello" in text(logs) and "rank 1" not in text(logs)
    assert text(handlers).strip() == "handlers restored"  # after spawns that returned and raised
    # Rank 0's bar: one line redrawn with carriage returns, not a line per step.
    assert "Epoch 2/2" in text(spawned) and "\r" in text(spawned)
    assert "step 1/4" not in text(spawned)
    # In the kernel itself: tqdm's widget, and no lines.
    assert sum(WIDGET in o.get("data", {}) for o in widget.outputs) == 2  # one per epoch
    assert "step " not in text(widget)


INTERRUPTED = """
import os, signal, sys, threading, time
import hapi

def wait(folder):
    open(os.path.join(folder, os.environ["RANK"]), "w").close()
    time.sleep(100)

def interrupt(folder):  # Ctrl-C once both processes run
    while len(os.listdir(folder)) < 2:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)

handlers = {number: signal.getsignal(number) for number in signal.valid_signals()}
threading.Thread(target=interrupt, args=(sys.argv[1],), daemon=True).start()
try:
    hapi.spawn(wait, args=(sys.argv[1],), nprocs=2)
except KeyboardInterrupt as error:
    print(f"KeyboardInterrupt: {error}")
after = {number: signal.getsignal(number) for number in signal.valid_signals()}
print("handlers restored" if after == handlers else "handlers changed")
"""


def test_ctrl_c_in_an_interactive_session_stops_the_processes(tmp_path):
    """``python -c`` has no file either: forked processes; Ctrl-C is a KeyboardInterrupt."""
    started = tmp_path / "started"
    started.mkdir()
    env = child_env(PYTHONPATH=str(REPO))
    done = run_bounded([sys.executable, "-c", INTERRUPTED, str(started)], 120, env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == [
        "KeyboardInterrupt: hapi.spawn: its processes were stopped.",
        "handlers restored",
    ], done.stdout


def test_forking_after_cuda_was_initialised_is_a_clear_error(monkeypatch):
    import torch

    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # no file
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already initialised CUDA.*Restart the kernel"):
        hapi.spawn(print, nprocs=2)


def test_a_text_bar_without_ipywidgets(monkeypatch, capsys):
    """In a kernel without ipywidgets: tqdm's text bar, and no "IProgress not found" warning."""
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", types.ModuleType("ipykernel.zmqshell"))
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets fails
    for name in ("tqdm.autonotebook", "tqdm.notebook"):  # chosen afresh, then put back
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert callbacks.progbar._bar_class(2).__module__ == "tqdm.std"  # a forked process
    bar = ProgBarLogger(log_freq=1, verbose=1)
    bar.set_params({"epochs": 1, "steps": 3, "rank": 0, "world_size": 1})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bar.on_epoch_begin(0)
        for step in range(3):
            bar.on_train_batch_end(step, {"batch_size": 4, "loss": 0.5})
        bar.on_epoch_end(0, {"loss": 0.5})
    assert not caught, [str(w.message) for w in caught]
    out = capsys.readouterr().out
    assert "Epoch 1/1" in out and "3/3" in out and "\r" in out
    assert "step 1/3" not in out
