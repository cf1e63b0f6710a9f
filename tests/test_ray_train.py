"""Model.fit under Ray Train (local Ray, 2 CPU workers): one process's figures, Ray's checkpoints.

examples/ray_fit.py runs examples/global_batch.py's training in TorchTrainer's workers with
callbacks.RayTrainReport. Its result carries the last epoch's figures, equal to what one process
gives the same program at the global batch (as torchrun's 2 processes do, test_global_batch.py);
its checkpoint loads into a fresh Model; and a second run
under the same name resumes from that checkpoint, ending where one uninterrupted fit ends.
One Ray for the module: its start takes most of the time.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

pytest.importorskip("ray.train", reason="ray[train] is in the test extra: pip install -e '.[test]'")
import ray  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
import global_batch  # noqa: E402
import ray_fit  # noqa: E402

from callbacks import LambdaCallback, RayTrainReport  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    # The workers import this checkout's hapi and the examples, as this process does.
    path = os.pathsep.join([str(ROOT), str(EXAMPLES), os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": path,
                "OMP_NUM_THREADS": "1",
                # Ray gives its workers 60 s to start: too few on a busy shared machine.
                "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600",
            }
        },
    )
    yield
    ray.shutdown()


def loaded_weights_sum(result) -> float:
    model = ray_fit.make_model()
    with result.checkpoint.as_directory() as directory:
        model.load(os.path.join(directory, RayTrainReport.FILE))
    return sum(p.detach().sum().item() for p in model.network.parameters())


def test_figures_equal_one_process_and_a_second_run_resumes_from_the_checkpoint(
    local_ray, tmp_path
):
    result = ray_fit.make_trainer(epochs=2, storage_path=str(tmp_path)).fit()
    expected = global_batch.main(["--batch-size", "32", "--epochs", "2"])  # 2 workers at 16
    assert set(result.metrics) == {"loss", "acc", "val_loss", "val_acc"}
    assert all(type(value) is float for value in result.metrics.values())
    assert result.metrics["val_loss"] == pytest.approx(expected["loss"], abs=2e-6)
    assert result.metrics["val_acc"] == pytest.approx(expected["acc"], abs=1e-9)
    assert loaded_weights_sum(result) == pytest.approx(expected["weights_sum"], abs=1e-5)

    # The same name and storage: Ray hands the last checkpoint to the new run, which resumes.
    resumed = ray_fit.make_trainer(epochs=3, storage_path=str(tmp_path)).fit()
    alone = global_batch.main(["--batch-size", "32", "--epochs", "3"])  # one process, no stop
    assert resumed.metrics["val_loss"] == pytest.approx(alone["loss"], abs=2e-6)
    assert resumed.metrics["val_acc"] == pytest.approx(alone["acc"], abs=1e-9)
    assert loaded_weights_sum(resumed) == pytest.approx(alone["weights_sum"], abs=1e-5)


@pytest.mark.parametrize("checkpoint", [True, False])
def test_each_epoch_reports_its_logs_and_a_checkpoint_that_loads(monkeypatch, checkpoint):
    reports = []

    def report(metrics, checkpoint=None):  # Ray's, outside a Ray worker: record each call
        weights = None
        if checkpoint is not None:  # read now: the directory is gone once report returns
            model = ray_fit.make_model()
            model.load(os.path.join(checkpoint.path, RayTrainReport.FILE))
            weights = [p.detach().clone() for p in model.network.parameters()]
        reports.append((metrics, weights))

    monkeypatch.setattr(ray.train, "report", report)
    model, epoch_logs = ray_fit.make_model(), []
    model.fit(
        ray_fit.make_data(64, seed=1),
        eval_data=ray_fit.make_data(20, seed=2),
        batch_size=32,
        epochs=2,
        verbose=0,
        callbacks=[
            RayTrainReport(checkpoint=checkpoint),
            LambdaCallback(on_epoch_end=lambda epoch, logs: epoch_logs.append(dict(logs))),
        ],
    )
    assert [metrics for metrics, _ in reports] == epoch_logs  # training and val_ figures
    assert set(epoch_logs[0]) == {"loss", "acc", "val_loss", "val_acc"}
    final = [p.detach() for p in model.network.parameters()]
    if checkpoint:
        for saved, trained in zip(reports[-1][1], final):
            assert saved.equal(trained)
    else:
        assert [weights for _, weights in reports] == [None, None]


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.train", None)  # as if not installed
    with pytest.raises(ImportError, match=r'pip install "ray\[train\]"'):
        RayTrainReport()
