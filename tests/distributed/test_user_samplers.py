"""A user's own sampler keeps its meaning on several processes: its stream is split, never replaced.

The usual train/validation split of one data set (``SubsetRandomSampler``) must
train only on the training indices, ``WeightedRandomSampler`` must never draw a
zero-weight sample, a deterministic sampler of the user's own must train like one
process at the global batch, and a batch sampler of the user's own keeps its batches.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
from dist_helpers import WORKER, assert_close_lists, child_env, read_ranks, run_python, torchrun

SCRIPT = WORKER.parent / "samplers_script.py"
sys.path.insert(0, str(WORKER.parent))
import samplers_script  # noqa: E402

TRAIN = set(samplers_script.TRAIN_INDICES)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    result = run_python([str(SCRIPT), str(out)], 120, child_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "samplers.rank0.json").read_text())


@pytest.mark.parametrize("world", [2, 3])
def test_user_samplers_are_split_not_replaced(tmp_path, one_process, world):
    torchrun(["--standalone", f"--nproc_per_node={world}", str(SCRIPT), str(tmp_path)])
    ranks = read_ranks(tmp_path, "samplers", world)

    # SubsetRandomSampler: together the processes read the training split once per epoch
    # (padded by a repeat to equal shares: 30 indices on 3 processes need none, on 2 none),
    # and never a held-out index; each epoch is reshuffled.
    for epoch in range(2):
        read = [i for rank in ranks for i in rank["subset_epochs"][epoch]]
        assert sorted(read) == sorted(TRAIN)
        assert not set(read) & set(samplers_script.HELD_OUT)
    assert ranks[0]["subset_epochs"][0] != ranks[0]["subset_epochs"][1]

    # WeightedRandomSampler: 40 draws an epoch in all (ceil(40/world) per process), never
    # a zero-weight index.
    for epoch in range(2):
        read = [i for rank in ranks for i in rank["weighted_epochs"][epoch]]
        assert len(read) == math.ceil(40 / world) * world
        assert not set(read) & samplers_script.ZERO_WEIGHT

    # A user's epoch-aware sampler: told each epoch (epoch 3 is not epoch 0 again), and together
    # the processes' k-th batches are its k-th batch of 6 at that epoch, as on one process.
    for records, processes in ((ranks, world), ([one_process], 1)):
        for epoch in range(4):
            sampler = samplers_script.EpochAware()
            sampler.set_epoch(epoch)
            order, share = list(sampler), 6 // processes
            for k in range(len(order) // 6):
                read = [
                    i
                    for rank in records
                    for i in rank["epoch_aware_epochs"][epoch][k * share : (k + 1) * share]
                ]
                assert sorted(read) == sorted(order[k * 6 : (k + 1) * 6]), (processes, epoch, k)

    # A deterministic sampler: N processes at batch 6/N train like one at 6, exactly.
    for rank in ranks:
        assert_close_lists(rank["fixed_order_weights"], one_process["fixed_order_weights"])

    # A batch sampler of the user's own: its batches are dealt out whole, every batch once.
    # (padded with its first batches to an equal count per process, as training needs).
    expected = [tuple(batch) for batch in samplers_script.OddBatches()]
    for epoch in range(2):
        read = [i for rank in ranks for i in rank["batch_sampler_epochs"][epoch]]
        assert set(read) == set(range(samplers_script.SAMPLES))
        padding = expected[: math.ceil(len(expected) / world) * world - len(expected)]
        assert len(read) == samplers_script.SAMPLES + sum(len(batch) for batch in padding)

    # Evaluation keeps the validation split; prediction returns the sampler's order.
    for rank in ranks:
        for name, value in one_process["eval_subset"].items():
            assert rank["eval_subset"][name] == pytest.approx(value, abs=1e-6)
        assert_close_lists(rank["predict_fixed"], one_process["predict_fixed"], atol=1e-6)
    assert sorted(i for rank in ranks for i in rank["predict_read"]) == sorted(TRAIN)

    # A sampler with no length cannot be split: a clear error, not a hang or a replacement.
    for rank in ranks:
        assert rank["endless"].startswith("DistributedSetupError")
        assert "has no length" in rank["endless"] and "Endless" in rank["endless"]
