"""model.save(..., wait=False): training goes on while the file is written; nothing half-written survives."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from torch import nn

import hapi
from hapi.checkpoint import CheckpointError
from hapi.checkpoint import state as checkpoint


def prepared() -> hapi.Model:
    torch.manual_seed(0)
    model = hapi.Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    return model


@pytest.fixture
def release(monkeypatch) -> threading.Event:
    """Background writes wait until the test sets the event it returns."""
    release, real_write = threading.Event(), checkpoint.write_file

    def slow_write(state, target, **options):
        release.wait(30)
        real_write(state, target, **options)

    monkeypatch.setattr(checkpoint, "write_file", slow_write)
    return release


def test_the_file_holds_the_state_of_the_moment_of_the_save(tmp_path, release):
    model = prepared()
    at_save = {k: v.clone() for k, v in model.network.state_dict().items()}
    model.save(tmp_path / "ckpt", wait=False)
    assert not (tmp_path / "ckpt.pt").exists()  # returned before the write
    model.fit(make_tiny_data(32), batch_size=8, verbose=0)  # training changes the weights meanwhile
    release.set()
    model.wait_for_saves()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)["network"]
    assert all(torch.equal(saved[k], at_save[k]) for k in at_save)
    assert not all(torch.equal(saved[k], v) for k, v in model.network.state_dict().items())


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_a_relative_path_is_written_where_it_named_when_save_was_called(
    tmp_path, monkeypatch, release, sharded
):
    model = prepared()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    model.save("ckpt", wait=False, sharded=sharded)
    os.chdir("elsewhere")  # the script moves on while the write runs
    release.set()
    model.wait_for_saves()
    assert [p.name for p in (tmp_path / "elsewhere").iterdir()] == []
    file = tmp_path / ("ckpt/checkpoint.pt" if sharded else "ckpt.pt")
    assert torch.load(file, weights_only=True)["step"] == 0


def test_a_failed_background_write_keeps_the_previous_file_and_is_reported(tmp_path, monkeypatch):
    model = prepared()
    model.save(tmp_path / "ckpt")
    before = (tmp_path / "ckpt.pt").read_bytes()

    def full_disk(obj, handle, *args, **kwargs):
        handle.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    model.save(tmp_path / "ckpt", wait=False)
    with pytest.raises(
        CheckpointError,
        match=r"Could not write the checkpoint '.*ckpt.pt': the disk is full \(No space left on "
        r"device\); free space there or save to another disk. The previous file there is unchanged",
    ):
        model.wait_for_saves()
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind
    model.wait_for_saves()  # reported once


def test_an_entry_that_could_not_be_loaded_is_refused_at_once(tmp_path):
    model = prepared()
    model.optimizer.param_groups[0]["schedule"] = object()
    with pytest.raises(
        CheckpointError, match=r"param_groups'\]\[0\]\['schedule'\] is a builtins.object"
    ):
        model.save(tmp_path / "ckpt", wait=False)
    assert not (tmp_path / "ckpt.pt").exists()


KILLED_WHILE_WRITING = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, {root!r})
    import hapi
    from torch import nn
    model = hapi.Model(nn.Linear(1000, 1000))
    with torch.no_grad():
        model.network.weight.fill_(1.0)
    model.save({path!r})
    # A second save of ~200 MB, killed (no cleanup) while its background write runs.
    model.network.extra = nn.Parameter(torch.full((50_000_000,), 2.0))
    model.save({path!r}, wait=False)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_process_killed_during_a_background_write_leaves_the_previous_file_whole(tmp_path):
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parents[2])
    script = KILLED_WHILE_WRITING.format(root=root, path=str(tmp_path / "ckpt"))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == -9, result.stderr[-2000:]
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert "extra" not in state["network"] and torch.all(state["network"]["weight"] == 1.0)


def test_repeated_background_saves_leave_one_whole_file_each_holding_its_moment(tmp_path):
    model = prepared()
    for _ in range(4):
        at_save = {k: v.clone() for k, v in model.network.state_dict().items()}
        model.save(tmp_path / "backup", wait=False)
        model.wait_for_saves()
        saved = torch.load(tmp_path / "backup.pt", weights_only=True)["network"]
        assert all(
            torch.equal(saved[k], at_save[k]) for k in at_save
        )  # staging buffers reused, not stale
        model.fit(make_tiny_data(16), batch_size=8, verbose=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backup.pt"]  # no temporary left
    state = torch.load(tmp_path / "backup.pt", weights_only=True)
    assert state["step"] == 6 and not (tmp_path / "backup.pt").read_bytes().endswith(b"\0" * 64)


FAILS_AT_EXIT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    import hapi
    from torch import nn
    model = hapi.Model(nn.Linear(4, 4))
    model.save({path!r})

    def full_disk(obj, handle, *args, **kwargs):
        raise OSError(28, "No space left on device")

    torch.save = full_disk
    model.save({path!r}, wait=False)  # the script ends while it is written, and fails
""")


def test_a_background_write_that_fails_as_the_script_ends_is_said(tmp_path):
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parents[2])
    script = FAILS_AT_EXIT.format(root=root, path=str(tmp_path / "ckpt"))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        f"torch-hapi: Could not write the checkpoint {str(tmp_path / 'ckpt.pt')!r}: the disk is full"
        in result.stderr
    )
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["network"]  # the previous file


FORKED_WHILE_WRITING = textwrap.dedent("""
    import os, signal, sys, tempfile, threading
    sys.path.insert(0, {root!r})
    import hapi
    from torch import nn
    model = hapi.Model(nn.Linear(3000, 3000))
    model.save({path!r}, wait=False)  # still being written when the child is forked
    pid = os.fork()
    if pid == 0:  # a DataLoader worker ends as multiprocessing's children do
        signal.alarm(20)
        threading._shutdown()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    model.wait_for_saves()
    print(os.waitstatus_to_exitcode(status))
""")


def test_a_child_forked_during_a_background_write_does_not_wait_for_it_at_its_end(tmp_path):
    """A DataLoader worker forked while a backup is being written ends at once: the write's
    thread is the parent's (a child waiting for it hung until killed)."""
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parents[2])
    script = FORKED_WHILE_WRITING.format(root=root, path=str(tmp_path / "ckpt"))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["0"]
