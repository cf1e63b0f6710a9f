"""model.save(path, sharded=True): every process writes its shards; any world size and strategy reads them."""

from __future__ import annotations

import json

import pytest
from dist_helpers import WORKER, child_env, run_python, torchrun

SCRIPT = WORKER.parent / "sharded_script.py"


def _facts(out, name):
    return json.loads((out / f"{name}.json").read_text())


def _one_process(*args):
    result = run_python([str(SCRIPT), *map(str, args)], 120, child_env())
    assert result.returncode == 0, result.stderr[-4000:]


def test_saved_on_two_fsdp_processes_loads_on_one_three_and_through_ddp(tmp_path):
    fsdp_dir, ddp_dir = tmp_path / "fsdp2", tmp_path / "from_ddp"
    torchrun(
        [
            "--standalone",
            "--nproc_per_node=2",
            str(SCRIPT),
            str(tmp_path),
            "saved",
            "fsdp",
            "-",
            str(fsdp_dir),
        ]
    )
    saved = _facts(tmp_path, "saved")
    # Every process wrote its own shard file (rank 0 also the manifest).
    shards = next(fsdp_dir.glob("shards-*"))
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (fsdp_dir / "checkpoint.pt").is_file()

    _one_process(tmp_path, "one", "auto", fsdp_dir)
    torchrun(
        [
            "--standalone",
            "--nproc_per_node=3",
            str(SCRIPT),
            str(tmp_path),
            "three",
            "fsdp",
            str(fsdp_dir),
        ]
    )
    torchrun(
        [
            "--standalone",
            "--nproc_per_node=2",
            str(SCRIPT),
            str(tmp_path),
            "ddp",
            "ddp",
            str(fsdp_dir),
            str(ddp_dir),
        ]
    )
    torchrun(
        [
            "--standalone",
            "--nproc_per_node=2",
            str(SCRIPT),
            str(tmp_path),
            "back",
            "fsdp",
            str(ddp_dir),
        ]
    )
    assert len(saved["optimizer"]) == 8 and saved["step"] > 0
    for name in ("one", "three", "ddp", "back"):
        facts = _facts(tmp_path, name)
        assert facts["weights"] == pytest.approx(saved["weights"], abs=0), name
        assert facts["optimizer"] == saved["optimizer"], name  # Adam's moments and step, resharded
        assert facts["groups"] == saved["groups"], name
        assert facts["step"] == saved["step"], name
