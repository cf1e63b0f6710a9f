"""Every seed example (examples/*.py, multi_machine.sh) runs end to end on small files.

In-process where a single process suffices (each ``main(argv)`` returns its
results); for real, but tiny, where the point is several processes:
spawn_train with two processes, multi_machine.sh with two torchrun agents on
127.0.0.1, and basic_loop under ``torchrun --nproc_per_node=2``. Python with
torch-hapi takes seconds to start here, so there are as few processes as that
allows.
"""

from __future__ import annotations

import importlib
import json
import math
import pathlib

import pytest
import torch
from cifar_files import write_cifar_binary
from dist_helpers import child_env, run_bounded, torchrun, torchrun_command
from idx_files import make_mnist_dir
from torch import nn

from hapi.datasets import FashionMNIST

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture
def examples(monkeypatch):
    """Import an example by name; spawn's children import it the same way (sys.path is passed on)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


@pytest.fixture
def mnist(tmp_path):
    return make_mnist_dir(tmp_path / "data", n_train=96, n_test=40)


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _check_figures(results: dict, keys: set[str]) -> None:
    assert set(results) == keys
    assert all(math.isfinite(value) for value in results.values() if not isinstance(value, list)), (
        results
    )
    assert 0.0 <= results["acc" if "acc" in results else "acc_top1"] <= 1.0
    assert results["loss"] > 0


def _printed(capsys) -> dict:
    reports = _json_lines(capsys.readouterr().out)
    assert len(reports) == 1, reports
    return reports[0]


def test_basic_loop_and_basic_model_run_the_same_program(examples, mnist, tmp_path, capsys):
    for name in ("basic_loop", "basic_model"):
        out = tmp_path / name
        results = examples(name).main(
            ["--data-root", str(mnist), "--epochs", "2", "--num-iters", "4", "--output", str(out)]
        )
        _check_figures(results, {"loss", "acc", "fit_seconds"})
        assert _printed(capsys) == {k: round(v, 4) for k, v in results.items()}
        assert (out / "model.pt").is_file()
    loop_net, model_net = (
        examples("basic_loop").seed_network(),
        examples("basic_model").seed_network(),
    )
    assert str(loop_net) == str(model_net)  # one network, two ways to train it
    assert [p.shape for p in loop_net.parameters()] == [(512, 784), (512,), (10, 512), (10,)]


def test_basic_loop_under_torchrun_evaluates_every_test_image_once(examples, mnist, tmp_path):
    out = tmp_path / "out"
    result = torchrun(
        [
            "--standalone",
            "--nproc_per_node=2",
            str(EXAMPLES / "basic_loop.py"),
            "--data-root",
            str(mnist),
            "--epochs",
            "2",
            "--num-iters",
            "3",
            "--output",
            str(out),
        ],
        timeout=120,
    )
    reports = _json_lines(result.stdout)
    assert len(reports) == 1, result.stdout  # rank 0 only
    _check_figures(reports[0], {"loss", "acc", "fit_seconds"})
    # The saved weights, evaluated on one process over all 40 test images, give
    # what the two processes reported: each image counted once, counts summed.
    network = examples("basic_loop").seed_network()
    network.load_state_dict(torch.load(out / "model.pt", weights_only=True))
    network.eval()
    test = FashionMNIST(root=mnist, mode="test")
    with torch.no_grad():
        logits = network(test.images.unsqueeze(1).float() / 255)
    assert reports[0]["acc"] == round((logits.argmax(1) == test.labels).double().mean().item(), 4)
    assert reports[0]["loss"] == pytest.approx(
        nn.functional.cross_entropy(logits, test.labels).item(), abs=1e-4
    )


def test_spawn_train_on_two_processes(examples, mnist, tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # spawn shares the cores out itself
    out = tmp_path / "out"
    results = examples("spawn_train").main(
        [
            "--data-root",
            str(mnist),
            "--num-iters",
            "1",
            "--nprocs",
            "2",
            "--output",
            str(out),
            "--log-dir",
            str(tmp_path / "log"),
        ]
    )
    _check_figures(results, {"loss", "acc_top1", "acc_top2", "fit_seconds", "world_size"})
    assert results["world_size"] == 2
    printed = capfd.readouterr().out
    assert (
        "Distributed training on 2 processes: batch_size 64 per process, global batch 128"
        in printed
    )
    assert "Eval samples: 40" in printed  # 20 + 20: every test image once
    reports = _json_lines(printed)
    assert reports == [{k: round(v, 4) for k, v in results.items()}]  # the parent's only
    assert type(reports[0]["world_size"]) is int, printed  # a count: the line says 2, not 2.0
    assert {p.name for p in (out / "checkpoints").iterdir()} == {"0.pt", "final.pt"}
    assert {p.name for p in (tmp_path / "log").glob("workerlog.*")} == {
        "workerlog.0",
        "workerlog.1",
    }


def test_multi_machine_script_runs_hapitrain_on_two_agents(mnist, tmp_path, free_port):
    out = tmp_path / "out"
    env = child_env(
        PORT=str(free_port),
        RDZV_ID="seed-test",
        TORCHRUN=torchrun_command(),
    )
    result = run_bounded(
        [
            "bash",
            str(EXAMPLES / "multi_machine.sh"),
            "--data-root",
            str(mnist),
            "--num-iters",
            "1",
            "--output",
            str(out),
        ],
        150,
        env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert (
        "Distributed training on 2 processes: batch_size 64 per process, global batch 128"
        in result.stdout
    )
    reports = _json_lines(result.stdout)
    assert len(reports) == 1, result.stdout  # hapitrain reports on rank 0 only
    _check_figures(reports[0], {"loss", "acc_top1", "acc_top2", "fit_seconds"})
    assert {p.name for p in (out / "checkpoints").iterdir()} == {"0.pt", "final.pt"}


def test_resnet18_is_d2ls_variant_and_scales_lr_with_processes(
    examples, mnist, tmp_path, capsys, monkeypatch
):
    module = examples("resnet18_fashion")
    net = module.resnet18(10)
    residuals = [m for m in net.modules() if isinstance(m, module.Residual)]
    assert len(residuals) == 8 and sum(r.conv3 is not None for r in residuals) == 3
    assert not any(isinstance(m, nn.MaxPool2d) for m in net.modules())
    assert net[0].kernel_size == (3, 3) and net[0].stride == (1, 1) and net[0].out_channels == 64
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)

    out = tmp_path / "out"
    argv = [
        "--data-root",
        str(mnist),
        "--epochs",
        "1",
        "--subset",
        "8",
        "--test-subset",
        "4",
        "--batch-size",
        "8",
        "--output",
        str(out),
    ]
    results = module.main(argv)
    keys = {"loss", "acc", "seconds_per_epoch", "lr", "global_batch", "world_size", "train_images"}
    _check_figures(results, keys)
    assert (results["lr"], results["global_batch"], results["train_images"]) == (0.1, 8, 8)
    assert results["seconds_per_epoch"] > 0
    printed = _printed(capsys)
    assert printed["acc"] == round(results["acc"], 4)
    counts = {name: printed[name] for name in ("global_batch", "world_size", "train_images")}
    assert counts == {"global_batch": 8, "world_size": 1, "train_images": 8}
    assert all(type(value) is int for value in counts.values()), (
        counts
    )  # counts print as 8, not 8.0
    assert (out / "model.pt").is_file()
    with pytest.raises(ValueError, match="--subset must be a positive number"):
        module.main([*argv, "--subset", "0"])
    # The chapter's rule: 2 processes at 256 each train at global batch 512 with lr 0.2.
    monkeypatch.setattr(module, "world_size", lambda: 2)
    assert module.main([*argv, "--test-subset", "1"])["lr"] == pytest.approx(0.2)


def test_cifar10_fleet_trains_through_the_users_distributed_batch_sampler(
    examples, tmp_path, capsys, monkeypatch
):
    module = examples("cifar10_fleet")
    data = tmp_path / "cifar"
    write_cifar_binary(
        data, train_per_batch=16, test=12
    )  # 80 training images: 2 full batches of 32
    epochs_seen: list[int] = []
    original = module.DistributedBatchSampler.set_epoch
    monkeypatch.setattr(
        module.DistributedBatchSampler,
        "set_epoch",
        lambda self, epoch: (epochs_seen.append(epoch), original(self, epoch))[1],
    )
    out = tmp_path / "out"
    results = module.main(
        ["--data-root", str(data), "--epochs", "2", "--num-workers", "0", "--output", str(out)]
    )
    _check_figures(results, {"loss", "acc", "val_acc_history", "val_loss_history", "fit_seconds"})
    assert len(results["val_acc_history"]) == len(results["val_loss_history"]) == 2
    assert epochs_seen == [0, 1]  # fit kept the user's loader and told its sampler each epoch
    assert "step 2/2 - loss: " in capsys.readouterr().out  # drop_last: 80 images -> 2 batches of 32
    assert (out / "model.pt").is_file()
    assert module.MyNet()(torch.zeros(2, 3, 32, 32)).shape == (2, 10)

    # The sampler itself: disjoint shards covering the data, reshuffled per epoch.
    dataset = range(80)
    shards = [
        module.DistributedBatchSampler(dataset, 8, num_replicas=2, rank=r, shuffle=True)
        for r in (0, 1)
    ]
    first = [[i for batch in shard for i in batch] for shard in shards]
    assert sorted(first[0] + first[1]) == list(range(80))
    shards[0].set_epoch(1)
    assert [i for batch in shards[0] for i in batch] != first[0]
