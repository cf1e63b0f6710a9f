"""hapi.metrics.Accuracy (Paddle's metric on torchmetrics) and metric naming."""

from __future__ import annotations

import pytest
import torch
import torchmetrics

from hapi.metrics import Accuracy, MetricSet, normalise_metrics


def test_topk_accuracy_matches_a_hand_count():
    scores = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.1, 0.4], [0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    labels = torch.tensor([[1], [2], [0], [2]])  # Paddle's [N, 1] labels
    metric = Accuracy(topk=(1, 2))
    metric.update(scores[:2], labels[:2])
    metric.update(scores[2:], labels[2:])
    result = metric.compute()
    # top-1 right: sample 0 only; top-2 right: samples 0, 1 -> 1/4 and 2/4.
    assert set(result) == {"acc_top1", "acc_top2"}
    assert result["acc_top1"].item() == pytest.approx(0.25)
    assert result["acc_top2"].item() == pytest.approx(0.5)


def test_names_follow_paddle():
    assert Accuracy().names() == ["acc"]
    assert Accuracy(topk=(1, 5)).names() == ["acc_top1", "acc_top5"]
    assert Accuracy(topk=(1, 2), name="top").names() == ["top_top1", "top_top2"]


def test_metric_set_means_over_all_batches():
    metrics = MetricSet({"acc": Accuracy()}, with_loss=True)
    metrics.update(
        torch.tensor(1.0), [torch.tensor([[1.0, 0.0]] * 3)], [torch.tensor([0, 0, 0])], 3
    )
    metrics.update(torch.tensor(4.0), [torch.tensor([[1.0, 0.0]])], [torch.tensor([1])], 1)
    assert metrics.compute() == {"loss": pytest.approx((1.0 * 3 + 4.0) / 4), "acc": 0.75}
    metrics.reset()
    assert metrics.compute() == {}


def test_derived_names_are_stable_and_unique():
    names = list(
        normalise_metrics(
            [
                torchmetrics.classification.MulticlassAccuracy(num_classes=3),
                torchmetrics.classification.MulticlassAccuracy(num_classes=3),
                Accuracy(),
            ]
        )
    )
    assert names == ["multiclass_accuracy", "multiclass_accuracy_2", "acc"]


@pytest.mark.parametrize("topk", [(), (0,), (1.5,)])
def test_bad_topk(topk):
    with pytest.raises(ValueError, match="topk"):
        Accuracy(topk=topk)


def test_scores_with_too_few_classes_for_topk():
    with pytest.raises(ValueError, match=r"C >= 5"):
        Accuracy(topk=(1, 5)).update(torch.rand(4, 3), torch.tensor([0, 1, 2, 0]))


def test_a_vector_valued_metric_is_refused_with_advice():
    metrics = MetricSet(
        {"per_class": torchmetrics.classification.MulticlassAccuracy(num_classes=3, average=None)},
        with_loss=False,
    )
    metrics.update(None, [torch.rand(6, 3)], [torch.tensor([0, 1, 2, 0, 1, 2])], 6)
    with pytest.raises(ValueError, match="average='micro'"):
        metrics.compute()
