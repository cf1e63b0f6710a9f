"""A train_step of the user's own on 2 processes: the copies of both networks never drift apart."""

from __future__ import annotations

from dist_helpers import WORKER, read_ranks, torchrun

SCRIPT = WORKER.parent / "gan_script.py"


def test_a_gan_keeps_both_networks_identical_on_every_process(tmp_path):
    torchrun(["--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path)])
    first, second = read_ranks(tmp_path, "gan", 2)
    # Each process drew its own noise and read its own batches: only averaged gradients
    # (and rank 0's starting weights) keep the two copies equal.
    assert first["generator"] == second["generator"]
    assert first["discriminator"] == second["discriminator"]
    # An override calling super().train_step: its gradients are averaged too.
    assert first["wrapped"] == second["wrapped"]
    assert first["history"] == second["history"] and set(first["history"]) == {
        "d_loss",
        "g_loss",
        "lr_0",
        "lr_1",
    }
