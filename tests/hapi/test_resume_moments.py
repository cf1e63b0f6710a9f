"""A checkpoint taken at a step holds that step whole: its evaluation, and the training figures."""

from __future__ import annotations

from conftest import make_tiny_data, tiny_model

from callbacks import Callback, ModelCheckpoint
from hapi import Model
from hapi.metrics import Accuracy

X, Y = make_tiny_data(60)
DATA, EVAL = (X, Y), (X[:20], Y[:20])


def _model() -> Model:
    return tiny_model(0.3, Accuracy(), momentum=0.9)


def _fit(model: Model, **options):
    return model.fit(
        DATA, eval_data=EVAL, batch_size=10, epochs=2, verbose=0, eval_steps=2, **options
    )


def test_a_step_checkpoint_holds_that_steps_evaluation(tmp_path):
    uninterrupted = _fit(_model())
    _fit(_model(), callbacks=[ModelCheckpoint(tmp_path, save_steps=2, resumable=True)])
    resumed = _fit(_model(), resume_from=tmp_path / "step-4.pt")
    steps = [e["step"] for e in resumed.evaluations]
    assert steps == [e["step"] for e in uninterrupted.evaluations]  # step 4's is not lost
    assert steps[:2] == [2, 4]
    assert [round(e["loss"], 6) for e in resumed.evaluations] == [
        round(e["loss"], 6) for e in uninterrupted.evaluations
    ]


def test_a_save_during_an_evaluation_keeps_the_training_figures(tmp_path):
    uninterrupted = _fit(_model())

    class SaveWhileEvaluating(Callback):
        def on_eval_end(self, logs=None):
            if self.model.step == 4 and self.model.epoch_step == 4:  # mid-epoch, not the epoch's
                self.model.save(tmp_path / "during_eval", resumable=True)

    _fit(_model(), callbacks=[SaveWhileEvaluating()])
    resumed = _fit(_model(), resume_from=tmp_path / "during_eval.pt")
    assert resumed.history["loss"] == uninterrupted.history["loss"]  # not the evaluation's loss
    assert resumed.history["acc"] == uninterrupted.history["acc"]


def test_resuming_the_same_program_warns_of_no_callback_difference(tmp_path):
    import warnings

    def checkpoint():
        return ModelCheckpoint(tmp_path, resumable=True)

    _fit(_model(), callbacks=[checkpoint()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(_model(), callbacks=[checkpoint()], resume_from=tmp_path / "0.pt")
    assert not [w for w in caught if "callbacks" in str(w.message)], [
        str(w.message) for w in caught
    ]

    class Other(Callback):
        pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(_model(), callbacks=[checkpoint(), Other()], resume_from=tmp_path / "0.pt")
    differ = [str(w.message) for w in caught if "differ from this fit's" in str(w.message)]
    assert differ and "'Other'" in differ[0] and "ResumeFrom" not in differ[0]
