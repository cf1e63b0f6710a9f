"""Resume matrix: a run killed at a chosen point and resumed by BackupAndRestore trains each
sample once per epoch, and where the number of processes is kept, exactly as a run never
interrupted.

Every sample carries its id (an extra input column); the network logs, per process, the
ids of each training batch with its epoch and ``model.step`` (resume_matrix_script.py).
For each cell the crashed run's batches up to the backup's optimizer step (read from
the backup file before the resume) plus the resumed run's batches must hold each sample
of the epoch once, bar the repeats that pad N processes' shards to equal length (at most
N - 1 samples per run that pads the epoch; whole batches for a user's batch sampler,
whose batches are dealt out whole). Where the number of processes is kept, each
process's id sequence per epoch, the final weights (max |dw| < 1e-6, dropout makes
them depend on the restored RNG) and ``History.evaluations`` must equal the
uninterrupted run's.

The cells (``resume_matrix_script.CELLS``; data / processes before -> after / crash):

====================================  ==============  =========  ===================  =====
cell                                  data            procs      crash point          extra
====================================  ==============  =========  ===================  =====
tensors-1to1-mid_epoch                (x, y) tensors  1 -> 1     mid-epoch
loader_shuffle-w2-1to1-after_save     DataLoader      1 -> 1     right after a save   2 workers
                                      (shuffle=True)
batch_sampler-1to1-mid_epoch          user batches    1 -> 1     mid-epoch
weighted-1to1-eval_boundary           Weighted...     1 -> 1     eval_steps boundary  eval_steps=2
dataset-w2-2to2-mid_accumulation      Dataset         2 -> 2     mid-accumulation     2 workers
batch_sampler-2to2-eval_boundary      user batches    2 -> 2     eval_steps boundary  eval_steps=2
tensors-own_streams-2to2-mid_epoch    (x, y) tensors  2 -> 2     mid-epoch            own streams
tensors-fsdp-2to2-after_save          (x, y) tensors  2 -> 2     right after a save   FSDP
subset-2to1-mid_epoch                 SubsetRandom    2 -> 1     mid-epoch
dataset-fsdp-2to1-mid_accumulation    Dataset         2 -> 1     mid-accumulation     FSDP
subset_gen-1to2-epoch1                SubsetRandom    1 -> 2     in epoch 1
                                      + Generator
tensors-w2-1to2-mid_accumulation      (x, y) tensors  1 -> 2     mid-accumulation     2 workers
weighted-2to3-mid_epoch               Weighted...     2 -> 3     mid-epoch
loader_shuffle-2to3-epoch1            DataLoader      2 -> 3     in epoch 1
torch_batch_sampler-1to2-mid_epoch    DataLoader      1 -> 2     mid-epoch
                                      (BatchSampler)
torch_batch_sampler-2to1to1-mid_epoch DataLoader      2 -> 1     mid-epoch, then      again
                                      (BatchSampler)  -> 1       again on 1
====================================  ==============  =========  ===================  =====

Why this subset: every data kind appears at least once with the number of processes
kept (where the id order and weights can be compared exactly) and, except the
map-style Dataset (covered 2 -> 1 under FSDP instead), once with it changed; every
crash point appears at least twice, on one process and on several; every change of
the number of processes appears with at least two data kinds, one of them a user's
DataLoader (on one process it is used as given, on several it is resharded, so a
change of N changes the code path); FSDP appears kept (2 -> 2) and changed (2 -> 1);
worker processes appear for fit's own loader (tensors, Dataset) and a user's
DataLoader. Every cell seeds all processes alike but one, seeded by
``hapi.seed_everything(0, per_process=True)`` with its backup directory relative to the
working directory: there dropout differs between the processes, so restoring one
process's random state on another changes the weights. The full product (7 x 5 x 5 x 2, plus workers) would take an hour of
process starts; each cell here costs one start or less.

Cost: a process start (import torch and hapi) takes 4-10 s on this machine, a torchrun
twice that, and each cell needs a crashed and a resumed run. So one launcher process
imports once and forks every run's processes with the environment torchrun gives its
workers (RANK, WORLD_SIZE, MASTER_ADDR/PORT; a fresh port per run), killing the others
when one dies, as torchrun does; what torchrun adds beyond that (its agent's store,
restarts) is tested in test_resume.py. The whole matrix runs once per module (a
fixture, about 40-60 s); each cell is then one test, whose failure lists what went
wrong and the cell's output.
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys

import pytest
import torch
from dist_helpers import WORKER, child_env, run_bounded

SCRIPT = WORKER.parent / "resume_matrix_script.py"
sys.path.insert(0, str(SCRIPT.parent))
import resume_matrix_script as matrix  # noqa: E402

CELLS = matrix.CELLS
TIMEOUT = 400

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the launcher forks and uses Linux's prctl"
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every cell crashed, then every cell resumed (one launcher, which forks each run's
    processes); returns the output directory and each cell's part of the output."""
    out = tmp_path_factory.mktemp("resume_matrix")
    command = [sys.executable, str(SCRIPT), str(out), "crash+again+resume", ",".join(CELLS)]
    result = run_bounded(command, TIMEOUT, child_env(HAPI_DIST_TIMEOUT="60"))
    outputs: dict[str, str] = collections.defaultdict(str)
    for part in ("\n" + result.stderr).split("\n=== ")[1:]:
        outputs[part.split()[0]] += "=== " + part + "\n"
    if result.returncode != 0:
        for name in CELLS:
            outputs[name] += (
                f"the launcher exited with {result.returncode}:\n{result.stderr[-3000:]}"
            )
    return out, outputs


def _log(path: pathlib.Path) -> list[tuple[int, int, list[int]]]:
    """(epoch, model.step before the batch, sample ids) per training batch, in order."""
    if not path.exists():
        return []
    lines = (line.split() for line in path.read_text().splitlines() if line.strip())
    return [(int(e), int(s), [int(i) for i in ids]) for e, s, *ids in lines]


def _by_epoch(batches) -> dict[int, list[int]]:
    epochs: dict[int, list[int]] = collections.defaultdict(list)
    for epoch, _, ids in batches:
        epochs[epoch] += ids
    return epochs


def _json(path: pathlib.Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _count_problems(
    epoch: int, counts: collections.Counter, expected: list[int], allowed: int
) -> list[str]:
    missing = sorted(set(expected) - set(counts))
    foreign = sorted(set(counts) - set(expected))
    repeats = {i: n for i, n in counts.items() if n > 1}
    extra = sum(n - 1 for n in repeats.values())
    parts = []
    if missing:
        parts.append(f"ids {missing} never trained")
    if foreign:
        parts.append(f"ids {foreign} trained but not in the epoch's data")
    if extra > allowed:
        by_count = collections.defaultdict(list)
        for i, n in sorted(repeats.items()):
            by_count[n].append(i)
        said = ", ".join(
            f"{ids} {'twice' if n == 2 else f'{n} times'}" for n, ids in sorted(by_count.items())
        )
        parts.append(f"{said} ({extra} repeats, {allowed} allowed for padding)")
    return [f"epoch {epoch}: " + "; ".join(parts)] if parts else []


def _first_difference(got: list[int], want: list[int]) -> str:
    at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (
        f"from position {at} on: {got[at : at + 8]} instead of {want[at : at + 8]} "
        f"({len(got)} ids, uninterrupted {len(want)})"
    )


def problems_of(cell: matrix.Cell, directory: pathlib.Path) -> list[str]:
    """What the crashed-and-resumed run did wrong, in words (empty: the cell passes)."""
    if not (directory / "killed").exists():
        return ["the crashed run never reached its kill point (see the output below)"]
    resumed = [_json(directory / f"resumed.rank{r}.json") for r in range(cell.after)]
    if any(r is None for r in resumed):
        lost = [r for r, result in enumerate(resumed) if result is None]
        return [f"the resumed run left no result on rank(s) {lost}: it died or hung"]
    errors = [r["error"] for r in resumed if r["error"]]
    if errors:
        return [f"the resumed run raised:\n{errors[0]}"]
    step = resumed[0]["backup_step"]
    if step is None:
        return ["no backup file was there to resume from"]
    problems = []
    if resumed[0]["start"]["step"] != step:
        problems.append(
            f"the backup holds optimizer step {step}, but the resumed run started at step "
            f"{resumed[0]['start']['step']} ({resumed[0]['start']})"
        )
    runs = [(cell.before, "crashed")] + ([(cell.after, "crashed_again")] if cell.again else [])
    first_backup = step
    if cell.again is not None:  # the first crash's backup is the one the second run resumed
        if not (directory / "killed_again").exists():
            return ["the second crashed run never reached its kill point"]
        first_backup = json.loads((directory / "again_backup_step.json").read_text())
    cut = [first_backup, step]  # each crashed run counts up to the backup the next resumed
    wholes = [[_log(directory / f"{name}.rank{r}.log") for r in range(n)] for n, name in runs]
    kept = [[[b for b in log if b[1] < c] for log in whole] for whole, c in zip(wholes, cut)]
    crashed = kept[0]
    after = [_log(directory / f"resumed.rank{r}.log") for r in range(cell.after)]
    for epoch in range(matrix.EPOCHS):
        counts: collections.Counter = collections.Counter()
        allowed = 0
        for world, logs, whole in [
            (n, logs, whole) for (n, _), logs, whole in zip(runs, kept, wholes)
        ] + [(cell.after, after, after)]:
            trained = [i for log in logs for e, _, ids in log if e == epoch for i in ids]
            counts.update(trained)
            # A run pads the epoch's shards where it reads the epoch's end: the resumed
            # run always, the crashed one when it went on to a later epoch.
            reached_end = whole is after or any(e > epoch for log in whole for e, _, _ in log)
            if trained and reached_end:
                allowed += (world - 1) * cell.padding_unit
        problems += _count_problems(epoch, counts, cell.expected_ids, allowed)
    if cell.before != cell.after:
        return problems
    reference = [_json(directory / f"reference.rank{r}.json") for r in range(cell.before)]
    if reference[0] is None or reference[0]["error"]:
        return problems + [
            f"the uninterrupted run failed: {reference[0] and reference[0]['error']}"
        ]
    for rank in range(cell.before):
        want = _by_epoch(_log(directory / f"reference.rank{rank}.log"))
        got = _by_epoch(crashed[rank] + after[rank])
        for epoch in range(matrix.EPOCHS):
            if got[epoch] != want[epoch]:
                problems.append(
                    f"rank {rank} epoch {epoch}: the id order differs from the uninterrupted "
                    f"run's {_first_difference(got[epoch], want[epoch])}"
                )
    difference = (
        (torch.tensor(resumed[0]["weights"]) - torch.tensor(reference[0]["weights"])).abs().max()
    )
    if difference >= 1e-6:
        problems.append(
            f"final weights differ from the uninterrupted run's: |dw| = {difference:.4g}"
        )
    if cell.eval_steps is not None:
        got_steps = [e["step"] for e in resumed[0]["evaluations"]]
        want_steps = [e["step"] for e in reference[0]["evaluations"]]
        if got_steps != want_steps:
            missing = sorted(set(want_steps) - set(got_steps))
            problems.append(
                f"evaluations at steps {got_steps}, uninterrupted run's at {want_steps}"
                + (f" (none at step(s) {missing})" if missing else "")
            )
        elif any(
            abs(a["loss"] - b["loss"]) > 1e-6
            for a, b in zip(resumed[0]["evaluations"], reference[0]["evaluations"])
        ):
            losses = [round(e["loss"], 6) for e in resumed[0]["evaluations"]]
            wanted = [round(e["loss"], 6) for e in reference[0]["evaluations"]]
            problems.append(f"evaluation losses {losses}, uninterrupted run's {wanted}")
    return problems


@pytest.mark.parametrize("name", list(CELLS))
def test_cell(runs, name):
    out, outputs = runs
    cell = CELLS[name]
    problems = problems_of(cell, out / name)
    if problems:
        details = "\n".join(f"  {p}" for p in problems)
        pytest.fail(
            f"{name} ({cell.data}, {cell.before} -> {cell.after} processes, crash "
            f"{cell.crash}, backup every {cell.save_freq} steps, killed at step "
            f"{cell.kill_step}):\n{details}\n\nlauncher output:\n{outputs[name][-4000:]}",
            pytrace=False,
        )


def test_the_accounting_names_what_is_missing_and_what_repeats():
    counts = collections.Counter([0, 1, 1, 2, 2, 2, 5])
    assert _count_problems(1, counts, [0, 1, 2, 3, 4], allowed=1) == [
        "epoch 1: ids [3, 4] never trained; ids [5] trained but not in the epoch's data; "
        "[1] twice, [2] 3 times (3 repeats, 1 allowed for padding)"
    ]
    assert _count_problems(0, collections.Counter([0, 1, 2, 0]), [0, 1, 2], allowed=1) == []
