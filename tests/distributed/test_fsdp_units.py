"""hapi.FSDP on 2 CPU processes: tied weights, the optimizer's shards, export after sharded training."""

from __future__ import annotations

import sys
import warnings

import pytest
from dist_helpers import WORKER, assert_close_lists, read_ranks, torchrun
from torch import nn

from hapi.distributed.fsdp import selected_units

SCRIPT = WORKER.parent / "fsdp_units_script.py"
sys.path.insert(0, str(SCRIPT.parent))
import fsdp_units_script as units  # noqa: E402

# A regression that makes a process wait for another (a sharded forward on rank 0
# alone) then fails within HAPI_DIST_TIMEOUT, and the run within TIMEOUT_S.
DIST_TIMEOUT_S = "20"
TIMEOUT_S = 150


def _run(tmp_path_factory, *scenarios: str) -> list[dict]:
    out = tmp_path_factory.mktemp("units")
    torchrun(
        ["--standalone", "--nproc_per_node=2", str(SCRIPT), str(out), *scenarios],
        timeout=TIMEOUT_S,
        HAPI_DIST_TIMEOUT=DIST_TIMEOUT_S,
    )
    return read_ranks(out, "units", 2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _run(tmp_path_factory, "optimizer", "tied")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return _run(tmp_path_factory, "export")


def test_export_after_fsdp_training_writes_the_whole_model_and_the_group_survives(exported):
    # Before: rank 0 ran the sharded forward alone and waited for rank 1's shards until
    # HAPI_DIST_TIMEOUT; the error blamed example_inputs and the group was left broken.
    rank0, rank1 = exported
    for name in ("blocks", "tied"):
        assert rank0[f"{name}_export_difference"] < 1e-5  # the program computes predict()'s outputs
        assert rank0[f"{name}_copy_difference"] < 1e-5
        assert rank0[f"{name}_copy_parameters"] == ["Parameter"]  # full tensors, no DTensor
        assert rank0[f"{name}_copy_hooks"] == 0  # none of FSDP's forward hooks
        assert not any(c.startswith("FSDP") for c in rank0[f"{name}_copy_classes"])
        for rank in exported:
            assert rank[f"{name}_still_sharded"]  # the network trained on is left as it was
            assert rank[f"{name}_trained_after_export"]
    assert rank0["tied_copy_tie_kept"]
    for rank in exported:  # hapi.export.export_network on the sharded network: refused, not run
        assert rank["direct_export_error"].startswith("Blocks's parameters are sharded over")
        assert "example_inputs" not in rank["direct_export_error"].split("Call model.export")[0]
    assert "blocks_export_difference" not in rank1  # rank 0 alone writes


def test_tied_embedding_trains_under_fsdp_like_one_process_at_the_global_batch(trained):
    # Before: "Parameter 'fc2.weight' is shared with a parameter already managed by
    # another FSDP group", reported as a problem with the inputs.
    one = units.train_tied(None, 2 * units.PER_PROCESS_BATCH)
    expected = {name: t.flatten().tolist() for name, t in one.network.state_dict().items()}
    assert one.network.fc2.weight is one.network.emb.weight
    for rank in trained:
        assert rank["tie_kept"]
        for recipe in ("tied", "tied_wrap"):
            assert sorted(rank[recipe]) == sorted(expected)
            for name, values in expected.items():
                assert_close_lists(rank[recipe][name], values, atol=1e-5)
            assert rank[recipe]["fc2.weight"] == rank[recipe]["emb.weight"]


def test_a_wrap_naming_tied_modules_warns_and_keeps_them_in_the_root_unit(trained):
    for rank in trained:
        (message,) = rank["tied_wrap_warnings"]
        assert "'emb'" in message and "'fc2'" in message and "untie" in message
        assert rank["tied_wrap_units"] == ["", "body.0", "body.2"]  # "" is the root


def test_the_optimizer_steps_the_networks_shards(trained):
    for rank in trained:
        assert rank["optimizer_is_users"]
        assert rank["optimized_are_dtensors"] == [True] * 8
        assert rank["optimized_are_network_parameters"]
        assert rank["state_is_sharded"]  # momentum buffers are shards too
        assert rank["state_keys_are_network_parameters"]


def test_default_units_leave_tied_modules_to_the_root_silently():
    network = units.TiedLM()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = selected_units(network, None)
    assert chosen == [network.body]


def test_units_that_share_only_inside_themselves_are_kept():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.b.weight = self.a.weight

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pair = Pair()
            self.head = nn.Linear(3, 2)

    network = Outer()
    assert selected_units(network, None) == [network.head, network.pair]
    with pytest.warns(UserWarning, match=r"'pair\.a' shares pair\.b\.weight"):
        chosen = selected_units(network, {nn.Linear})
    assert chosen == [network.head]
