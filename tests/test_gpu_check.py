"""benchmarks/gpu_check.py, run on the CPU as the GPU machine runs it, so it works the day a GPU is lent.

The very same checks run with ``--device cpu --quick`` (Gloo under torchrun);
each must pass with its figures, none may be missing, and a check that breaks
must be reported as failed, never dropped.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
from dist_helpers import child_env, run_python

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
CHECKS = [
    "fit_vs_hand_loop",
    "amp_fp16",
    "amp_bf16",
    "pinned_workers",
    "background_save",
    "export",
    "ddp_one_process",
    "fsdp_one_process",
    "resnet18_epoch",
    "compile",
]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "lines.jsonl"
    # From the repository root with PYTHONPATH=., as docs/benchmarks.md tells the GPU machine.
    result = run_python(
        [str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out)],
        timeout=300,
        env=child_env(PYTHONPATH="."),
        cwd=REPO,
    )
    return result, out


def test_every_check_runs_and_passes_on_cpu(cpu_run):
    result, out = cpu_run
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert result.returncode == 0, (result.stdout, result.stderr[-3000:])
    assert [line["check"] for line in lines[:-1]] == CHECKS
    assert all(line["ok"] for line in lines[:-1]), lines
    assert lines[-1]["passed"] == len(CHECKS) and lines[-1]["failed"] == []
    assert lines[-1]["device"] == "cpu" and lines[-1]["quick"] is True
    assert out.read_text().splitlines() == result.stdout.splitlines()  # --out holds the same lines


def test_the_figures_are_measured(cpu_run):
    figures = {line.get("check"): line for line in map(json.loads, cpu_run[0].stdout.splitlines())}
    for name in ("fit_vs_hand_loop", "amp_fp16", "amp_bf16", "pinned_workers", "compile"):
        assert figures[name]["max_weight_difference"] <= 1e-5, figures[name]
    assert figures["fit_vs_hand_loop"]["time_ratio"] > 0
    fp16 = figures["amp_fp16"]
    assert fp16["skipped_steps"] >= 1 and fp16["hand_scale"] == fp16["fit_scale"] < 65536.0
    saved = figures["background_save"]
    assert saved["difference_from_call"] == 0.0 and saved["difference_from_trained_on"] > 0
    assert figures["export"]["outputs"] == [256, 10]  # --quick: 256 samples
    assert figures["ddp_one_process"]["backend"] == "gloo"
    assert figures["fsdp_one_process"]["difference_from_ddp"] == 0.0
    assert figures["fsdp_one_process"]["peak_memory_mb"] > 0
    resnet = figures["resnet18_epoch"]
    assert resnet["fit_samples_per_s"] > 0 and resnet["hand_samples_per_s"] > 0


def test_a_failing_check_is_reported_and_fails_the_run(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))

    def broken(setup):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setitem(gpu_check.CHECKS, "broken", broken)
    out = tmp_path / "lines.jsonl"
    status = gpu_check.main(["--device", "cpu", "--checks", "broken", "--out", str(out)])
    line, summary = [json.loads(text) for text in out.read_text().splitlines()]
    assert status == 1
    assert line["ok"] is False and "RuntimeError: no kernel image" in line["error"]
    assert summary["failed"] == ["broken"] and summary["passed"] == 0
    with pytest.raises(SystemExit):
        gpu_check.main(["--checks", "fit_vs_hand_loop,nope"])
    assert "unknown check(s) nope" in capsys.readouterr().err
