"""Evaluation after training with BatchNorm, and evaluate/predict-only runs, are one model's figures.

DDP broadcasts buffers from rank 0 only at the start of a training forward: after the
last step each process holds its own running statistics. Every evaluation, prediction
and save must use rank 0's, so that N processes report what the saved model scores on one.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_data
from dist_helpers import WORKER, assert_close_lists, read_ranks, torchrun
from torch import nn

from hapi import Model
from hapi.metrics import Accuracy

SCRIPT = WORKER.parent / "buffers_script.py"


def _one_process(file, x, y):
    import sys

    sys.path.insert(0, str(WORKER.parent))
    import buffers_script  # noqa: PLC0415

    model = Model(buffers_script.bn_net())
    model.prepare(loss=nn.CrossEntropyLoss(), metrics=Accuracy())
    model.load(file)
    return (
        model.evaluate((x, y), batch_size=4, verbose=0),
        model.predict((x, y), batch_size=4, stack_outputs=True, verbose=0)[0].tolist(),
    )


def test_two_processes_evaluate_what_one_process_scores_from_the_saved_model(tmp_path):
    torchrun(["--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path)])
    ranks = read_ranks(tmp_path, "buffers", 2)
    # The setting is a real one: after fit the ranks' statistics differ...
    assert ranks[0]["local_mean_before_evaluate"] != ranks[1]["local_mean_before_evaluate"]
    # ...and evaluation gives everyone rank 0's.
    assert (
        ranks[0]["running_mean"]
        == ranks[1]["running_mean"]
        == ranks[0]["local_mean_before_evaluate"]
    )
    x, y = make_tiny_data(21, seed=1)
    for saved, prefix in (("bn.pt", ""), ("untrained.pt", "untrained_")):
        logs, predictions = _one_process(tmp_path / saved, x, y)
        for rank in ranks:
            for name, value in logs.items():
                assert rank[prefix + "evaluate"][name] == pytest.approx(value, abs=1e-6), (
                    saved,
                    name,
                )
            assert_close_lists(rank[prefix + "predict"], predictions, atol=1e-6)
    # Evaluate and predict alone never build DDP (nor reserve a gradient buffer).
    assert not ranks[0]["untrained_wrapped"] and not ranks[1]["untrained_wrapped"]
    assert (
        torch.load(tmp_path / "bn.pt", weights_only=True)["network"]["1.running_mean"].tolist()
        == ranks[0]["running_mean"]
    )
