"""Every script in benchmarks/ runs as docs/benchmarks.md tells users to run it, and prints its table.

Timings are never asserted (this machine's speed varies by +-15%); what a user
would notice is a benchmark that crashes or prints no figures. The scripts read
Fashion-MNIST through ``HAPI_DATA_HOME``, here small IDX files written by the
test, and run one round on a few hundred images.
"""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest
from dist_helpers import child_env, run_python
from idx_files import make_mnist_dir

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
NUMBER = r"[0-9][0-9,.]*"

# script, its arguments, and the rows its table must have (row name -> what follows it)
CASES = {
    "bench_framework.py": (
        ["--repeats", "1", "--samples", "256"],
        [
            "hand-written loop",
            "Model.fit verbose=0",
            "Model.fit verbose=2 (lines)",
            "Model.fit verbose=1 (tqdm bar)",
        ],
    ),
    "bench_datapath.py": (
        ["--repeats", "1", "--samples", "256"],
        [
            "hand loop, torchvision-style view",
            "hand loop, hapi per-sample __getitem__",
            "Model.fit on hapi FashionMNIST",
            "hand loop, whole batches by index (the limit)",
            "hapi loader, loading only",
        ],
    ),
    "bench_memory.py": (
        ["--samples", "256"],
        ["hand-written loop", "Model.fit (with Accuracy top-1/2)"],
    ),
    "bench_compile_amp.py": (
        ["--repeats", "1", "--samples", "128"],
        ["default", "amp='bf16'", "compile=True"],
    ),
    "bench_backup.py": (
        [
            "--repeats",
            "1",
            "--steps",
            "6",
            "--save-freq",
            "2",
            "--width",
            "64",
            "--threads",
            "1",
            "--paired-steps",
            "12",
        ],
        [
            "no backup",
            "BackupAndRestore(save_freq=2), background write",
            "the same, blocking write",
        ],
    ),
    "bench_fsdp_memory.py": (["--width", "64"], ["ddp", "fsdp"]),
    "bench_startup.py": (
        ["--imports", "1", "--jobs", "1", "--batches", "1"],
        ["import torch", "import hapi", "hand DDP script", "Model.fit"],
    ),
    "bench_scaling.py": (
        ["--repeats", "1", "--samples", "512", "--profile"],
        [
            "Model.fit | 1 | 1",
            "Model.fit | 1 | 2",
            "Model.fit | 2 | 1",
            "hand-written loop | 1 | 1",
            "hand-written loop (DDP, Gloo) | 2 | 1",
            "two hand-written loops, no communication | 2 | 1",
            "hand-written loop, shared-memory average | 2 | 1",
            # the profile: both ranks' time, split
            "Model.fit | 0",
            "Model.fit | 1",
            "hand-written loop, shared-memory average | 1",
        ],
    ),
}


def _verdict_row(row: str, target: str) -> str:
    """A row ending in its target, a verdict and the per-repeat ratios' spread (min..max)."""
    verdict = r"(met|NOT met)[^|]*"
    return rf"^\| {re.escape(row)} \|.*\| <= {re.escape(target)} \| {verdict} \| {NUMBER}\.\.{NUMBER} \|$"


# What else a script must print: bench_framework puts the documented target and a verdict beside each ratio,
# and how much the per-repeat ratios spread, so a reader can tell a miss from this machine's noise.


VERDICTS = {
    "bench_datapath.py": [
        rf"^Model\.fit vs the index-batch limit, per repeat: median {NUMBER}x \(target <= 1\.03x"
    ],
    "bench_scaling.py": [
        rf"^Model\.fit's speed-up on 2 processes as a share of the no-communication ceiling's, "
        rf"per round: median {NUMBER}"
    ],
    "bench_framework.py": [
        _verdict_row("Model.fit verbose=0", "1.02x"),
        _verdict_row("Model.fit verbose=2 (lines)", "1.03x"),
        _verdict_row("Model.fit verbose=1 (tqdm bar)", "1.03x"),
        rf"^This machine's variation: over 1 repeat\(s\), Model\.fit's per-repeat ratios span {NUMBER}\.\.",
    ],
}


@pytest.fixture(scope="module")
def data_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("data_home")
    make_mnist_dir(home / "fashion-mnist", n_train=512, n_test=64)
    return home


@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_prints_its_table(script, data_home):
    arguments, rows = CASES[script]
    # Run from benchmarks/, as docs/benchmarks.md says; each script finds common.py beside it.
    result = run_python(
        [str(BENCHMARKS / script), *arguments],
        timeout=240,
        env=child_env(HAPI_DATA_HOME=str(data_home)),
        cwd=BENCHMARKS,
    )
    assert result.returncode == 0, (
        f"{script} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )
    table_lines = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    for row in rows:
        matching = [line for line in table_lines if line.startswith(f"| {row} |")]
        assert matching, f"{script} printed no row {row!r}:\n{result.stdout}"
        figures = matching[0][len(f"| {row} |") :]
        assert re.search(NUMBER, figures), f"{script}'s row {row!r} has no figures: {matching[0]}"
    for pattern in VERDICTS.get(script, []):
        found = re.search(pattern, result.stdout, re.MULTILINE)
        assert found, f"{script} printed no line matching {pattern!r}:\n{result.stdout}"


def test_bench_framework_verdict_follows_the_ratio_of_medians(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = importlib.import_module("bench_framework")
    times = {
        "hand-written loop": [1.00, 1.00, 1.00],
        "Model.fit verbose=0": [1.01, 1.049, 1.10],  # median 1.049x: the newcomer's figure
        "Model.fit verbose=2 (lines)": [1.00, 1.02, 1.04],  # median 1.02x, target 1.03x
        "Model.fit verbose=1 (tqdm bar)": [1.031, 1.05, 1.06],
    }  # all above 1.03x
    rows = {
        line.split(" | ")[0][2:]: line
        for line in bench.with_verdicts(times, "t").splitlines()
        if line.startswith("| ")
    }
    assert rows["Model.fit verbose=0"].endswith(
        "| <= 1.02x | NOT met (target inside the spread: within noise) | 1.010..1.100 |"
    )
    assert rows["Model.fit verbose=2 (lines)"].endswith(
        "| <= 1.03x | met (target inside the spread: within noise) | 1.000..1.040 |"
    )
    assert rows["Model.fit verbose=1 (tqdm bar)"].endswith("| <= 1.03x | NOT met | 1.031..1.060 |")
    assert rows["hand-written loop"].endswith("| — | baseline | 1.000..1.000 |")
