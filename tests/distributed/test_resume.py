"""BackupAndRestore: a run killed mid-epoch and started again ends exactly like one never interrupted."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import TinyNet, make_tiny_data
from dist_helpers import WORKER, child_env, run_python, torchrun, two_machines
from torch import nn

from callbacks import BackupAndRestore
from hapi import Model

sys.path.insert(0, str(WORKER.parent))

SCRIPT = WORKER.parent / "resume_script.py"
KILL_AT_STEP = 8  # the backup is every 3 optimizer steps: steps 7 and 8 are done twice
MID_EPOCH_KILL = 10  # the last backup before it, at step 9, lies mid-epoch (batch 6 of 12)


def _run(out, *args, **env):
    return run_python([str(SCRIPT), str(out), *map(str, args)], 120, child_env(**env))


def _run_script(script, out, *args, **env):
    result = run_python([str(script), str(out), *map(str, args)], 120, child_env(**env))
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _result(out, rank=0):
    return json.loads((out / f"result.rank{rank}.json").read_text())


def _assert_same_run(resumed, reference):
    difference = (torch.tensor(resumed["weights"]) - torch.tensor(reference["weights"])).abs().max()
    assert difference < 1e-6
    for key in ("history", "early_stopping", "checkpoint_best", "lr", "step"):
        assert resumed[key] == reference[key], key


@pytest.fixture(scope="module")
def plain_references(tmp_path_factory):
    """Uninterrupted runs without augmentation, on 1 and on 2 processes (torchrun), shared by
    the tests that kill and resume the same runs."""
    one, two = tmp_path_factory.mktemp("plain_one"), tmp_path_factory.mktemp("plain_two")
    assert _run(one).returncode == 0
    torchrun(["--standalone", "--nproc_per_node=2", str(SCRIPT), str(two)])
    return one, two


def test_one_process_killed_mid_epoch_resumes_exactly(tmp_path, plain_references):
    reference_dir, crash_dir = plain_references[0], tmp_path / "crash"
    crash_dir.mkdir()
    killed = _run(crash_dir, KILL_AT_STEP)
    assert killed.returncode == 17, killed.stderr[-3000:]  # os._exit in the middle of epoch 2
    assert (crash_dir / "backup" / "backup.pt").exists()
    assert not (crash_dir / "result.rank0.json").exists()

    resumed = _run(crash_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "BackupAndRestore: resuming from" in resumed.stdout
    assert "batch 12 (optimizer step 6)" in resumed.stdout  # the last backup before the kill
    _assert_same_run(_result(crash_dir), _result(reference_dir))
    assert not _result(crash_dir)["backup_left"]  # removed once training ended


def test_two_processes_restarted_by_torchrun_resume_exactly(tmp_path, plain_references):
    reference_dir, crash_dir = plain_references[1], tmp_path / "crash"
    crash_dir.mkdir()
    result = torchrun(
        [
            "--standalone",
            "--nproc_per_node=2",
            "--max-restarts=1",
            str(SCRIPT),
            str(crash_dir),
            str(KILL_AT_STEP),
        ],
        KILL_RANK="1",
        RESTARTED_RANK_0_LATE_S="3",
    )
    output = result.stdout + result.stderr
    assert "BackupAndRestore: resuming from" in output
    # The restart prints no C++ stack trace: rank 1, restarted before rank 0, first finds the
    # failed attempt's store publication (it printed two "client socket has timed out" traces).
    assert "Exception raised from" not in output and "stack trace" not in output.lower(), output
    for rank in (0, 1):
        _assert_same_run(_result(crash_dir, rank), _result(reference_dir, rank))


@pytest.fixture(scope="module")
def augmented_references(tmp_path_factory):
    """Uninterrupted runs with random augmentation loaded in the main process, on 1 and on 2
    processes. Each batch's draws depend only on (seed, epoch, position, rank), so runs
    with worker processes must equal them too."""
    one, two = tmp_path_factory.mktemp("augmented_one"), tmp_path_factory.mktemp("augmented_two")
    assert _run(one, AUGMENT_WORKERS="0").returncode == 0
    torchrun(
        ["--standalone", "--nproc_per_node=2", str(SCRIPT), str(two)],
        AUGMENT_WORKERS="0",
        BACKUP_EVERY="2",
    )
    return one, two


@pytest.mark.parametrize("workers", [0, 2])
def test_random_augmentation_resumes_exactly_on_one_process(
    tmp_path, workers, augmented_references
):
    """__getitem__ draws noise from torch, NumPy and Python: each batch's draws depend only
    on (seed, epoch, batch position), not on the look-ahead fetch before a backup nor on
    which worker loads the batch after a restart."""
    assert _run(tmp_path, MID_EPOCH_KILL, AUGMENT_WORKERS=str(workers)).returncode == 17
    resumed = _run(tmp_path, AUGMENT_WORKERS=str(workers))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at epoch 2, batch 6 (optimizer step 9)" in resumed.stdout
    _assert_same_run(_result(tmp_path), _result(augmented_references[0]))


def test_the_run_resumes_from_the_last_backup_before_the_kill_however_slow_the_disk(
    tmp_path, augmented_references
):
    """Backups are written in the background; the one at step 9, a step before the kill,
    is the one resumed from even when each write takes a second (the kill waits for it)."""
    killed = _run(tmp_path, MID_EPOCH_KILL, AUGMENT_WORKERS="0", BACKUP_DELAY_S="1")
    assert killed.returncode == 17, killed.stderr[-3000:]
    resumed = _run(tmp_path, AUGMENT_WORKERS="0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at epoch 2, batch 6 (optimizer step 9)" in resumed.stdout
    _assert_same_run(_result(tmp_path), _result(augmented_references[0]))


@pytest.mark.parametrize("workers", [0, 2])
def test_random_augmentation_resumes_exactly_on_two_processes(
    tmp_path, workers, augmented_references
):
    """Each rank reads 6 batches (3 optimizer steps) an epoch: a backup every 2 steps puts
    the one at step 4 mid-epoch, and rank 1 dies at step 5."""
    result = torchrun(
        ["--standalone", "--nproc_per_node=2", "--max-restarts=1", str(SCRIPT), str(tmp_path), "5"],
        KILL_RANK="1",
        AUGMENT_WORKERS=str(workers),
        BACKUP_EVERY="2",
    )
    assert "at epoch 2, batch 2 (optimizer step 4)" in result.stdout + result.stderr
    for rank in (0, 1):
        _assert_same_run(_result(tmp_path, rank), _result(augmented_references[1], rank))


def test_two_machines_without_a_shared_file_system_resume_from_the_latest_backup(
    tmp_path, free_port, plain_references
):
    """Each "machine" (a torchrun agent) runs in its own directory, so a backup is seen
    only where rank 0 wrote it. After rank 1 dies, the agents meet again and may swap
    ranks (the healthy node restarts for free, the other spends its restart): both must
    resume from the latest backup, wherever it lies, and end as if never interrupted."""
    reference_dir = plain_references[1]
    machines = [tmp_path / "machine0", tmp_path / "machine1"]
    for directory in machines:
        directory.mkdir()
    outputs = two_machines(
        free_port,
        "hapi-no-shared-fs",
        [[str(SCRIPT), str(directory), str(KILL_AT_STEP)] for directory in machines],
        options=("--max-restarts=1",),
        KILL_RANK="1",
        KILL_MARKER=str(tmp_path / "killed"),
    )
    assert (tmp_path / "killed").exists()  # rank 1 did die mid-epoch
    assert "BackupAndRestore: resuming from" in "".join(outputs)
    results = {}
    for directory in machines:
        (written,) = directory.glob("result.rank*.json")  # one process per machine
        results[int(written.stem.removeprefix("result.rank"))] = json.loads(written.read_text())
    for rank in (0, 1):
        _assert_same_run(results[rank], _result(reference_dir, rank))
    for directory in machines:  # training ended: no machine keeps a backup to "resume" later
        assert not (directory / "backup" / "backup.pt").exists()


def _prepared():
    torch.manual_seed(0)
    model = Model(TinyNet())
    model.prepare(torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    return model


def test_backup_kept_on_request_and_a_finished_backup_resumes_nothing(tmp_path):
    data = make_tiny_data(32)
    _prepared().fit(
        data,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[BackupAndRestore(tmp_path, delete_checkpoint=False)],
    )
    assert (tmp_path / "backup.pt").exists()
    history = _prepared().fit(
        data, batch_size=8, epochs=2, verbose=0, callbacks=[BackupAndRestore(tmp_path)]
    )
    assert history.epoch == [0, 1]  # restored from the backup: both epochs already done
    assert not (tmp_path / "backup.pt").exists()


def test_a_damaged_backup_is_explained(tmp_path):
    (tmp_path / "backup.pt").write_bytes(b"PK\x03\x04 not really a checkpoint")
    with pytest.raises(
        RuntimeError,
        match=r"could not resume from .*backup\.pt.*truncated or corrupt.*"
        r"delete .*backup\.pt",
    ):
        _prepared().fit(
            make_tiny_data(16), batch_size=8, verbose=0, callbacks=[BackupAndRestore(tmp_path)]
        )


def test_resume_needs_a_running_fit_and_a_file_saved_during_one(tmp_path):
    model = _prepared()
    model.save(tmp_path / "plain")
    with pytest.raises(RuntimeError, match=r"resume=True.*fit\(resume_from=path\)"):
        model.load(tmp_path / "plain", resume=True)

    from callbacks import Callback

    class ResumeInTheLoop(Callback):  # a hook never rewrites the running fit
        def on_train_begin(self, logs=None):
            self.model.load(tmp_path / "plain", resume=True)

    with pytest.raises(RuntimeError, match=r"resume=True.*fit\(resume_from=path\)"):
        model.fit(make_tiny_data(16), batch_size=8, verbose=0, callbacks=[ResumeInTheLoop()])
    with pytest.raises(RuntimeError, match="was not saved to resume a fit"):
        model.fit(make_tiny_data(16), batch_size=8, verbose=0, resume_from=tmp_path / "plain")


@pytest.mark.parametrize("save_freq", [0, -1, "step", 2.5, True])
def test_bad_save_freq(save_freq, tmp_path):
    with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive number"):
        BackupAndRestore(tmp_path, save_freq=save_freq)


def test_a_job_that_loses_a_process_trains_the_rest_of_the_epoch_once(tmp_path):
    """2 processes, rank 1 killed mid-epoch 2 (after the backup at its batch 2), then the
    job goes on as 1 process: the interrupted epoch's samples are each trained once."""
    import elastic_script as es

    script = WORKER.parent / "elastic_script.py"
    killed = torchrun(
        ["--standalone", "--nproc_per_node=2", str(script), str(tmp_path), "9"], check=False
    )
    assert killed.returncode != 0
    resumed = _run_script(script, tmp_path)
    assert "at epoch 2, batch 0 (optimizer step 8)" in resumed.stdout  # batches counted anew on 1
    assert "split across the processes there are now" in resumed.stderr
    trained = []
    for rank in (0, 1):  # the two processes' first 2 batches of epoch 1, before the backup
        reads = [
            int(i)
            for e, i in (line.split() for line in open(tmp_path / f"reads.2.rank{rank}.txt"))
            if e == "1"
        ]
        trained += reads[: 2 * es.BATCH]
    trained += [
        int(i)
        for e, i in (line.split() for line in open(tmp_path / "reads.1.rank0.txt"))
        if e == "1"
    ]
    assert sorted(trained) == list(range(es.SAMPLES))  # none repeated, none skipped
    later = [
        int(i)
        for e, i in (line.split() for line in open(tmp_path / "reads.1.rank0.txt"))
        if e == "2"
    ]
    assert sorted(later) == list(range(es.SAMPLES))  # the next epoch is whole, on one process
