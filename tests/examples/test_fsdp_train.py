"""examples/fsdp_train.py as the strategies guide runs it: trained and saved sharded on 2
processes under torchrun, then loaded on 1 process, where it evaluates to the same loss."""

from __future__ import annotations

import pathlib

from dist_helpers import child_env, main_process_report, run_python, torchrun

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "fsdp_train.py"


def test_sharded_on_two_processes_loads_on_one(tmp_path):
    checkpoint = tmp_path / "ckpt" / "fsdp"
    two = main_process_report(
        torchrun(
            ["--standalone", "--nproc_per_node=2", str(EXAMPLE), "--save", str(checkpoint)]
        ).stdout
    )
    assert two["processes"] == 2 and two["sharded"] is True
    assert (checkpoint / "checkpoint.pt").is_file()
    assert len(list(checkpoint.glob("shards-*/__*_0.distcp"))) == 2  # one file per process

    one = run_python(
        [str(EXAMPLE), "--load", str(checkpoint), "--epochs", "0"],
        120,
        child_env(),
        cwd=tmp_path,
    )
    assert one.returncode == 0, one.stdout + one.stderr
    alone = main_process_report(one.stdout)
    assert alone["processes"] == 1 and alone["sharded"] is False
    assert abs(alone["loss"] - two["loss"]) < 1e-4, (alone, two)
    # Each of the two processes held about half of the parameters' bytes.
    assert two["parameter_bytes_here"] < 0.6 * alone["parameter_bytes_here"]
