"""Sharded saves in the background on 2 processes: what wait_for_saves() guarantees."""

from __future__ import annotations

import pytest
from dist_helpers import WORKER, assert_close_lists, read_ranks, torchrun

SCRIPT = WORKER.parent / "background_shards_script.py"
SHARDS = [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("background")
    run = torchrun(
        ["--standalone", "--nproc_per_node=2", str(SCRIPT), str(out)],
        timeout=150,
        check=False,  # each rank's file holds what it found before any failure
        HAPI_DIST_TIMEOUT="30",
    )
    return read_ranks(out, "background", 2), run


def test_once_wait_for_saves_returns_every_shard_and_the_manifest_are_on_disk(ranks):
    ranks, _ = ranks
    # The writer sleeps 2 s before writing: save() returned with nothing written yet, and
    # wait_for_saves() waits for every process's shards, DCP's metadata, then the manifest
    # (rank 0 writing the manifest without waiting for its own shards fails here).
    for rank in ranks:
        assert rank["sharded"]
        assert rank["pending_after_save"] == []
        assert rank["after_wait"] == SHARDS
        assert rank["manifest_after_wait"]
        assert rank["manifest_lead_s"] < 0.5  # written after the last shard, not 2 s before
        assert rank["load_error"] is None
        assert_close_lists(rank["loaded"], rank["trained"], atol=0)


def test_a_writers_error_on_one_process_is_raised_by_wait_for_saves_on_every_process(ranks):
    ranks, _ = ranks
    for rank in ranks:
        assert rank["error"] is not None, "wait_for_saves() returned after a failed write"
        assert rank["error"].startswith(("CheckpointError: ", "CheckpointWriteError: "))
        assert "No space left on device (provoked by the test)" in rank["error"]
        assert "previous file there is unchanged" in rank["error"]
        # ... and it was: the directory still loads the weights saved before.
        assert rank["load_previous_error"] is None
        assert_close_lists(rank["loaded_previous"], rank["previous"], atol=0)
        assert rank["saved_after_error"] == SHARDS  # and the processes still save together


def test_the_run_ends_cleanly(ranks):
    _, run = ranks
    assert run.returncode == 0, run.stderr[-4000:]
