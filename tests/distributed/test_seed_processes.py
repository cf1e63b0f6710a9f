"""hapi.seed_everything on 2 processes: each draws its own noise, reproducibly; the weights agree.

And hapi.distributed.rank()/is_main() give the launcher's answer before any Model exists.
"""

from __future__ import annotations

from dist_helpers import WORKER, read_ranks, torchrun

SCRIPT = WORKER.parent / "seed_script.py"


def test_seeded_processes_draw_their_own_noise_reproducibly_and_agree_on_weights(tmp_path):
    torchrun(["--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path)])
    first, second = read_ranks(tmp_path, "seed", 2)

    # Before the Model joined the process group, each process already knew its place.
    assert first["before"] == {"group_exists": False, "rank": 0, "world_size": 2, "is_main": True}
    assert second["before"] == {"group_exists": False, "rank": 1, "world_size": 2, "is_main": False}

    for rank in (first, second):
        (run, again) = rank["runs"]
        assert run == again  # the same seed: the same noise, samples and weights, run after run
    one, two = first["runs"][0], second["runs"][0]
    # What the script made after seeding (data, a split) is the same on every process: fit
    # shards one data set, not two.
    assert one["made_after_seeding"] == two["made_after_seeding"]
    assert len(one["noise"]) == len(two["noise"]) == 2
    assert one["noise"] != two["noise"]  # during fit, each process its own stream
    assert one["start"] == two["start"]  # training starts from one set of weights
    assert one["end"] == two["end"]
    # fit's shuffling agreed: the two shards of one shuffled order cover every sample once.
    assert sorted(one["seen"] + two["seen"]) == list(range(16))
    assert one["seen"] + two["seen"] != list(range(16))

    # Model.summary and Model.flops: computed on every process, printed by the first only.
    assert "Total params: 3" in first["printed"] and "Total Flops" in first["printed"]
    assert second["printed"] == ""
    assert first["summary"] == second["summary"] == {"total_params": 3, "trainable_params": 3}
    assert first["flops"] == second["flops"] > 0
