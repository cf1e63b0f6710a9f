"""The callback protocol and the list that dispatches it.

A callback sees the training run through three things only, so that it works
the same under any launcher and can be tested with a stub model:

* ``self.model`` -- the documented ``hapi.Model`` API: ``network``,
  ``optimizer``, ``stop_training``, ``epoch``, ``step``, ``save(path)``,
  ``load(path)``, ``parameters()``;
* ``self.params`` -- set once per ``fit``/``evaluate``/``predict``:
  ``epochs``, ``steps`` (batches per epoch, ``None`` when unknown),
  ``batch_size`` (per process), ``verbose``, ``log_freq``, ``metrics`` (the
  logged names, ``"loss"`` first), ``rank``, ``world_size``;
* the ``logs`` dict of each hook -- a fresh dict of Python floats per call:

  ===========================  ==============================================
  hook                          logs
  ===========================  ==============================================
  on_train_begin                ``{}``
  on_epoch_begin                ``{}``
  on_train_batch_begin          ``{}``
  on_before_optimizer_step      ``{}``; called with the batch's step before each
                                optimizer update, after gradients are averaged
                                across processes and unscaled (fp16), before
                                clipping: read or change ``p.grad`` here
  on_train_batch_end            ``batch_size``; every ``log_freq`` steps and on
                                the last step also ``loss`` and each metric
                                (running means over the epoch so far) and
                                ``samples``, the number of samples they cover
  on_eval_begin                 ``steps``, ``metrics``
  on_eval_batch_end             as on_train_batch_end, for evaluation
  on_eval_end                   ``loss`` and each metric over the whole set
  on_epoch_end                  the epoch's training figures, plus
                                ``val_<name>`` after an evaluation
  on_train_end                  the last epoch's logs
  on_predict_begin              ``steps``
  on_predict_batch_end          ``batch_size``
  on_predict_end                ``{}``
  ===========================  ==============================================

Training figures, and the figures of a whole evaluation, are reduced across
processes, so every rank sees the same values and decides the same way. The
running figures in the middle of an evaluation are this process's own (shards
may differ by a batch, so no collective is possible there); its last batch's
figures, like ``on_eval_end``'s, cover every process. A callback gates its own side effects (files,
printing) with :attr:`Callback.is_main`; it must never wrap ``model.save`` in
that test, because saving is collective (every rank calls it, rank 0 writes).
"""

from __future__ import annotations

from typing import Any, Iterable

# Hook names, in the order a fit with evaluation calls them. CallbackList
# precomputes, per hook, the callbacks that override it, so a hook nobody
# implements costs no call per batch.
HOOKS = (
    "on_train_begin",
    "on_epoch_begin",
    "on_train_batch_begin",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_eval_begin",
    "on_eval_batch_begin",
    "on_eval_batch_end",
    "on_eval_end",
    "on_epoch_end",
    "on_train_end",
    "on_predict_begin",
    "on_predict_batch_begin",
    "on_predict_batch_end",
    "on_predict_end",
)


class Callback:
    """Base class: every hook is a no-op; override the ones you need."""

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Any) -> None:
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = dict(params)

    @property
    def is_main(self) -> bool:
        """True on the process that prints and writes files (rank 0)."""
        return self.params.get("rank", 0) == 0

    def state_dict(self) -> dict[str, Any]:
        """What this callback must remember across a crash and resume.

        Saved in every checkpoint written during ``fit`` and given back to
        :meth:`load_state_dict` when ``BackupAndRestore`` resumes the run.
        Values must be tensors, numbers, strings, lists or dicts of them (the
        file is read with ``torch.load(weights_only=True)``).
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned."""

    def on_train_begin(self, logs: dict | None = None) -> None: ...

    def on_train_end(self, logs: dict | None = None) -> None: ...

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None: ...

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None: ...

    def on_train_batch_begin(self, step: int, logs: dict | None = None) -> None: ...

    def on_before_optimizer_step(self, step: int, logs: dict | None = None) -> None:
        """Before the update of training batch ``step`` (Lightning's name).

        The gradients in ``model.network``'s parameters are final -- averaged
        over processes, unscaled under ``amp="fp16"`` -- and not yet clipped;
        a callback may read or change them. With ``accumulate_grad_batches``
        it runs once per update, at the group's last batch. Under FSDP each
        process sees the gradient shards of its own parameters.
        """

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None: ...

    def on_eval_begin(self, logs: dict | None = None) -> None: ...

    def on_eval_end(self, logs: dict | None = None) -> None: ...

    def on_eval_batch_begin(self, step: int, logs: dict | None = None) -> None: ...

    def on_eval_batch_end(self, step: int, logs: dict | None = None) -> None: ...

    def on_predict_begin(self, logs: dict | None = None) -> None: ...

    def on_predict_end(self, logs: dict | None = None) -> None: ...

    def on_predict_batch_begin(self, step: int, logs: dict | None = None) -> None: ...

    def on_predict_batch_end(self, step: int, logs: dict | None = None) -> None: ...


def _overrides(callback: Callback, hook: str) -> bool:
    """Whether ``callback`` implements ``hook``: its class overrides it, and the instance
    did not list it in ``unused_hooks`` (a feature left off, e.g. ModelCheckpoint without
    ``save_steps``, costs the loop no per-batch call nor the figures read for it)."""
    return getattr(type(callback), hook, None) is not getattr(
        Callback, hook
    ) and hook not in getattr(callback, "unused_hooks", ())


class CallbackList:
    """Calls each hook on the callbacks that implement it, in list order.

    Every callback gets its own copy of ``logs``, so one callback mutating the
    dict cannot change what the next one sees.
    """

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks: list[Callback] = []
        self._handlers: dict[str, list] = {hook: [] for hook in HOOKS}
        for callback in callbacks:
            self.append(callback)

    def append(self, callback: Callback) -> None:
        if not isinstance(callback, Callback):
            raise TypeError(
                f"Every callback must be a callbacks.Callback instance; received "
                f"{callback!r} of type {type(callback).__name__}. Subclass "
                "callbacks.Callback and override the hooks you need."
            )
        self.callbacks.append(callback)
        for hook in HOOKS:
            if _overrides(callback, hook):
                self._handlers[hook].append(getattr(callback, hook))

    def __iter__(self):
        return iter(self.callbacks)

    def wants(self, hook: str) -> bool:
        """Whether any callback implements ``hook`` (lets the loop skip work)."""
        return bool(self._handlers[hook])

    def set_model(self, model: Any) -> None:
        for callback in self.callbacks:
            callback.set_model(model)

    def set_params(self, params: dict[str, Any]) -> None:
        for callback in self.callbacks:
            callback.set_params(params)

    @staticmethod
    def _fan_out(handlers: list, args: tuple, logs: dict | None) -> None:
        for handler in handlers:
            handler(*args, logs=dict(logs) if logs else {})

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_train_begin"], (), logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_train_end"], (), logs)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_epoch_begin"], (epoch,), logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_epoch_end"], (epoch,), logs)

    def on_train_batch_begin(self, step: int, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_train_batch_begin"], (step,), logs)

    def on_before_optimizer_step(self, step: int, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_before_optimizer_step"], (step,), logs)

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_train_batch_end"], (step,), logs)

    def on_eval_begin(self, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_eval_begin"], (), logs)

    def on_eval_end(self, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_eval_end"], (), logs)

    def on_eval_batch_begin(self, step: int, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_eval_batch_begin"], (step,), logs)

    def on_eval_batch_end(self, step: int, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_eval_batch_end"], (step,), logs)

    def on_predict_begin(self, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_predict_begin"], (), logs)

    def on_predict_end(self, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_predict_end"], (), logs)

    def on_predict_batch_begin(self, step: int, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_predict_batch_begin"], (step,), logs)

    def on_predict_batch_end(self, step: int, logs: dict | None = None) -> None:
        self._fan_out(self._handlers["on_predict_batch_end"], (step,), logs)
