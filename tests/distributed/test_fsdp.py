"""hapi.FSDP on 2 and 3 CPU processes: the training of one process at the global batch, sharded."""

from __future__ import annotations

import sys

import pytest
import torch
from dist_helpers import WORKER, assert_close_lists, read_ranks, torchrun

SCRIPT = WORKER.parent / "fsdp_script.py"
sys.path.insert(0, str(SCRIPT.parent))
import fsdp_script  # noqa: E402

FULL_PARAMETERS = 695  # Blocks: Linear(6, 24) + LayerNorm(24) + Linear(24, 17) + Linear(17, 3)


@pytest.fixture(scope="module", params=[2, 3], ids=["2 processes", "3 processes"])
def sharded_run(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"fsdp{world}")
    torchrun(["--standalone", f"--nproc_per_node={world}", str(SCRIPT), str(out)], timeout=240)
    return world, out, read_ranks(out, "fsdp", world)


@pytest.mark.parametrize("recipe", ["sgd", "adam", "accumulate", "clip", "options"])
def test_n_processes_train_like_one_at_the_global_batch(sharded_run, recipe):
    world, _, ranks = sharded_run
    one = fsdp_script.train(recipe, world * fsdp_script.PER_PROCESS_BATCH)
    for rank in ranks:
        assert_close_lists(rank[recipe], fsdp_script.full_weights(one), atol=1e-5)
        # the epoch figures too; with clipping, the total norm of the whole gradient, before clipping
        for sharded, single in zip(rank[f"{recipe}_logs"], one.epoch_logs.logs):
            assert sharded.keys() == single.keys()
            assert sharded == pytest.approx(single, rel=1e-5, abs=1e-6)
    if recipe == "clip":
        assert all(logs["grad_norm"] > 0.05 for logs in one.epoch_logs.logs)  # the clip did act


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_policy_trains_as_ddp_does(sharded_run, amp):
    # FSDP gathers bf16/fp16 weights (norm layers stay float32, as under autocast) and
    # reduces float32 gradients: exactly DDP's training with autocast on the same processes.
    world, _, ranks = sharded_run
    one = fsdp_script.full_weights(fsdp_script.train(amp, world * fsdp_script.PER_PROCESS_BATCH))
    for rank in ranks:
        assert_close_lists(rank[amp], rank[f"{amp}_ddp"], atol=1e-7)
        # Against one process, bf16/fp16 rounding of each process's gradients (as under DDP).
        assert_close_lists(rank[amp], one, atol=0.05)


def test_resume_under_fsdp_is_exact(sharded_run):
    world, _, ranks = sharded_run
    for rank in ranks:
        # The backup was sharded (each process wrote its own file), and the resumed
        # run ends with the weights of the run never interrupted.
        assert rank["sharded_backup"] == [f"__{r}_0.distcp" for r in range(world)]
        assert_close_lists(rank["resumed"], rank["adam"], atol=1e-7)


def test_each_process_holds_its_share_and_the_network_stays_the_users(sharded_run):
    world, _, ranks = sharded_run
    held = [rank["parameter_bytes"] for rank in ranks]
    assert sum(held) == FULL_PARAMETERS * 4
    assert max(held) <= FULL_PARAMETERS * 4 / world + 4 * 24  # at most a row per unit over 1/N
    assert [rank["optimizer_bytes"] for rank in ranks] == held  # SGD momentum: one buffer per shard
    for rank in ranks:
        assert rank["is_users_module"]
        assert rank["summary"] == {
            "total_params": FULL_PARAMETERS,
            "trainable_params": FULL_PARAMETERS,
        }


def test_evaluate_predict_and_the_saved_file_are_one_models(sharded_run):
    # The file saved under FSDP holds full plain tensors: one process loads it with
    # torch alone, and evaluating that model gives what the sharded processes reported
    # (13 samples split 7/6 or 5/4/4: shards of different lengths).
    _, out, ranks = sharded_run
    state = torch.load(out / "fsdp_final.pt", weights_only=True)
    network = fsdp_script.Blocks()
    network.load_state_dict(state["network"])
    optimizer = torch.optim.SGD(network.parameters(), lr=0.2, momentum=0.9)
    optimizer.load_state_dict(state["optimizer"])
    assert len(optimizer.state) == 8  # a momentum buffer for each of the 8 parameters
    from torchmetrics import Accuracy

    import hapi

    model = hapi.Model(network)
    model.prepare(
        loss=torch.nn.CrossEntropyLoss(), metrics=Accuracy(task="multiclass", num_classes=3)
    )
    figures = model.evaluate(fsdp_script.data(13), batch_size=2, verbose=0)
    predicted = model.predict(fsdp_script.data(13), batch_size=2, stack_outputs=True, verbose=0)[0]
    for rank in ranks:
        assert rank["evaluate"] == pytest.approx(figures, rel=1e-6)
        assert_close_lists(rank["predict"], predicted.tolist(), atol=1e-6)
