"""hapi.distributed.full_state_dict / load_full_state_dict on 1 and 2 processes: plain, DDP, FSDP.

Run under torchrun (Gloo), this file is also the script: each rank builds the
same network, wraps it each way, and writes OUT_DIR/full_state.rank<R>.json
with what it found. The layers have odd sizes, so FSDP's shards are uneven
(7 rows over 2 processes: 4 and 3).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
import torch
from torch import nn

TIMEOUT_S = 180


def _network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))


def _wrapped(kind: str) -> nn.Module:
    network = _network()
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(network)
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (network[0], network[2]):
            fully_shard(layer)
        fully_shard(network)
    return network


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def _case(kind: str) -> dict:
    import hapi.distributed as hd

    reference = _network().state_dict()
    changed = {key: value * 2 + 1 for key, value in reference.items()}
    network = _wrapped(kind)
    found = hd.full_state_dict(network)
    result = {
        "read_equal": _same(found, reference),
        "plain_tensors": all(type(v) is torch.Tensor for v in found.values()),
        "sharded_before": hd.sharded_parameters(hd.ddp.unwrap(network)),
    }
    hd.load_full_state_dict(network, changed)
    result["written_equal"] = _same(hd.full_state_dict(network), changed)
    result["sharded_after"] = hd.sharded_parameters(hd.ddp.unwrap(network))
    plain = _network()
    plain.load_state_dict(changed)
    x = torch.linspace(-1, 1, 20).reshape(4, 5)
    with torch.no_grad():
        result["forward_difference"] = float(
            (network.eval()(x) - plain.eval()(x)).abs().max().item()
        )
    try:
        hd.load_full_state_dict(network, {k: v for k, v in changed.items() if k != "0.weight"})
        result["missing_key_error"] = None
    except RuntimeError as error:
        result["missing_key_error"] = str(error)
    return result


def main(out: pathlib.Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {kind: _case(kind) for kind in ("plain", "ddp", "fsdp")}
    (out / f"full_state.rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[1, 2], ids=["1-process", "2-processes"])
def ranks(request, tmp_path_factory):
    from dist_helpers import read_ranks, torchrun

    out = tmp_path_factory.mktemp("full_state")
    processes = request.param
    torchrun(
        ["--standalone", f"--nproc_per_node={processes}", __file__, str(out)],
        timeout=TIMEOUT_S,
        HAPI_DIST_TIMEOUT="30",
    )
    return processes, read_ranks(out, "full_state", processes)


@pytest.mark.parametrize("kind", ["plain", "ddp", "fsdp"])
def test_every_process_reads_the_full_weights_and_writes_them_back(ranks, kind):
    processes, per_rank = ranks
    for results in per_rank:
        result = results[kind]
        assert result["read_equal"] and result["plain_tensors"]  # the user's keys, full tensors
        assert result["written_equal"]
        assert result["forward_difference"] < 1e-6  # each shard holds its own slice
        assert "0.weight" in result["missing_key_error"]  # strict, as load_state_dict
        every = [f"{layer}.{name}" for layer in (0, 1, 2) for name in ("weight", "bias")]
        sharded = every if kind == "fsdp" else []  # the root unit shards the BatchNorm's
        assert result["sharded_before"] == result["sharded_after"] == sharded  # still DTensors


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(pathlib.Path(sys.argv[1]))


class _RunningMean(nn.Module):
    """Keeps a running mean of its outputs without torch.no_grad, as VQ-style EMA code does:
    after a training forward the buffer is part of the autograd graph (no leaf)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("mean", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.mean.mul_(0.9).add_(0.1 * y.mean(0))
        return y


def test_the_plain_copy_export_makes_after_fsdp_keeps_a_buffer_in_the_graph():
    """model.export under FSDP exports a plain copy of the network: buffers are copied
    detached, so a buffer updated under autograd does not break the export."""
    from hapi.distributed import fsdp

    network = _RunningMean()
    network(torch.randn(2, 3))
    assert not network.mean.is_leaf
    copy = fsdp.plain_copy(network, network.state_dict())
    assert torch.equal(copy.mean, network.mean) and copy.mean.is_leaf
    assert copy.mean.data_ptr() != network.mean.data_ptr()  # a copy: export cannot touch the user's
    torch.testing.assert_close(copy(torch.ones(1, 3)), network(torch.ones(1, 3)))
