"""On 2 processes a schedule made by LRScheduler's factory runs its whole course, as on one
process at the global batch; EarlyStopping restores the best weights on every process (DDP,
FSDP, and FSDP after a crash and resume)."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest
from dist_helpers import WORKER, assert_close_lists, read_ranks, torchrun

SCRIPT = WORKER.parent / "schedule_script.py"
sys.path.insert(0, str(WORKER.parent))
import schedule_script  # noqa: E402

PER_PROCESS_BATCH = 4
END_LR = schedule_script.MAX_LR / 25 / 1e4  # OneCycleLR's end: initial_lr / final_div_factor


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The same recipes on this process, at the global batch (no process group: no FSDP)."""
    out = tmp_path_factory.mktemp("schedule1")
    return json.loads(json.dumps(schedule_script.run(out, 2 * PER_PROCESS_BATCH)))


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("schedule2")
    torchrun(
        ["--standalone", "--nproc_per_node=2", str(SCRIPT), str(out), str(PER_PROCESS_BATCH)],
        timeout=180,
    )
    return read_ranks(out, "schedule", 2)


def test_one_cycle_from_the_factory_has_the_same_course_on_two_processes(one, two):
    # 40 samples: one process reads 5 batches of 8 per epoch, each of two 5 batches of 4.
    assert one["schedule"]["updates"] == one["schedule"]["total"] == 2 * 5
    for rank in two:
        assert rank["schedule"]["total"] == rank["schedule"]["updates"] == 2 * 5
        assert rank["schedule"]["lrs"] == pytest.approx(one["schedule"]["lrs"], rel=1e-9)
        assert rank["schedule"]["lrs"][-1] == pytest.approx(END_LR)
        assert rank["schedule"]["final_lr"] == pytest.approx(END_LR)
    assert max(one["schedule"]["lrs"]) == pytest.approx(schedule_script.MAX_LR, rel=0.05)


def test_under_accumulation_the_schedule_counts_updates_on_two_processes(one, two):
    if not one["accumulate"]["params_have_accumulation"]:
        pytest.skip(
            "hapi.Model.fit does not put accumulate_grad_batches in the callbacks' params yet"
        )
    updates = 2 * math.ceil(5 / 2)  # 5 batches per epoch, 2 per update: groups of 2, 2 and 1
    for run in (one, *two):
        assert run["accumulate"]["total"] == run["accumulate"]["updates"] == updates
        assert run["accumulate"]["lrs"] == pytest.approx(one["accumulate"]["lrs"], rel=1e-9)
        assert run["accumulate"]["final_lr"] == pytest.approx(END_LR)


@pytest.mark.parametrize("scenario", ["restore_ddp", "restore_fsdp", "resumed_fsdp"])
def test_every_process_ends_with_the_best_epochs_weights(one, two, scenario):
    whole = two[0]["restore_fsdp"] if scenario == "resumed_fsdp" else two[0][scenario]
    for rank in two:
        result = rank[scenario]
        assert result["best_epoch"] == 0
        assert_close_lists(result["final"], whole["per_epoch"][0], atol=1e-6)
        # the last epoch's weights differ: the restoration did something
        assert max(abs(a - b) for a, b in zip(result["final"], whole["per_epoch"][-1])) > 1e-3
    if scenario == "resumed_fsdp":
        assert all(len(rank[scenario]["per_epoch"]) == 1 for rank in two)  # only epoch 2 ran again
    if scenario == "restore_ddp":  # one process at the global batch trains and restores alike
        assert_close_lists(two[0][scenario]["final"], one[scenario]["final"], atol=1e-5)


def test_a_backup_of_two_processes_resumes_on_one_at_the_same_point_of_its_schedule(
    one, two, tmp_path
):
    """The factory's schedule is made anew for the shrunk job's total (two processes' 10
    updates become one's 20) and continues at the same fraction of its course, to its end."""
    whole = schedule_script.shrink(PER_PROCESS_BATCH, tmp_path)["lrs"]
    with pytest.warns(UserWarning, match="saved by 2 processes, on 1"):
        resumed = schedule_script.shrink(PER_PROCESS_BATCH, pathlib.Path(two[0]["shrink_backup"]))
    assert resumed["total"] == len(whole) == 20
    # Backed up at update 7 of 10: 14 of 20 done, the rest of the epoch is 6 updates here.
    assert resumed["updates"] == 7 + 6
    assert resumed["lrs"] == pytest.approx(whole[14:], rel=1e-9)
    assert resumed["lrs"][-1] == pytest.approx(END_LR)


def test_a_part_refused_on_one_process_is_refused_on_every_process(two):
    # Rank 1's random state in the file is None: rank 0's part is fine, and it must not go on
    # alone into training (where it would wait for rank 1 until a timeout).
    refused = [rank["refused"] for rank in two]
    assert all(message and "'per_rank'[1]['rng']" in message for message in refused), refused
