"""The callback protocol (:class:`Callback`) and the list that dispatches it (:class:`CallbackList`).

How to write a callback -- ``self.model``, ``self.params``, the ``logs`` of each
hook, ``is_main``, ``state_dict`` -- is the docstring of :class:`Callback`.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Iterable, NoReturn


class Callback:
    """Base class of every callback: each hook is a no-op; override the ones you need.

    A callback is code that runs at fixed points of ``fit``, ``evaluate`` and
    ``predict`` -- to log, save, stop early or change the learning rate --
    without touching the loop. It sees the run through three things only, so
    that it works the same under any launcher and can be tested with a stub
    model:

    * ``self.model`` -- the :class:`hapi.Model` being run (set by
      :meth:`set_model`). Use its public API only: ``network``, ``optimizer``,
      ``optimizers``, ``parameters()``, ``stop_training`` (set it to ``True``
      to end ``fit``), ``stop_evaluating``, ``stop_predicting``, ``epoch``,
      ``epoch_step``, ``step``, ``sharded``, ``save(path)``, ``load(path)``.
    * ``self.params`` -- the run's settings (set by :meth:`set_params` before
      the first hook): ``epochs`` (``None`` outside ``fit``), ``steps``
      (batches per epoch, ``None`` when unknown), ``batch_size`` (per
      process), ``verbose``, ``log_freq``, ``metrics`` (the logged names,
      ``"loss"`` first), ``rank`` and ``world_size``; during ``fit`` also
      ``accumulate_grad_batches``, ``num_iters``, ``eval_steps`` and, when
      ``fit`` got one, ``save_dir``.
    * ``logs`` -- each hook's dict of figures, a fresh dict of Python floats per
      call (changing it changes nothing for the next callback). Its names are
      ``"loss"``, each metric's name (``prepare(metrics=...)``), figures a
      :meth:`hapi.Model.train_step` of your own returns, ``grad_norm`` when
      clipping, and ``"val_" + name`` for evaluation figures at the epoch's
      end. Each hook's docstring says which keys it gets.

    Every hook runs on every process. Training figures and the figures of a
    whole evaluation are reduced across processes, so every process sees the
    same values and decides the same way (EarlyStopping stops all of them at
    once). Gate your own side effects -- printing, files, dashboards -- with
    :attr:`is_main`; never put ``self.model.save`` under that test, because
    saving is collective (every process calls it, the main one writes).

    A callback that must survive a crash and a resume (a counter, a best
    value) returns that state from :meth:`state_dict` and takes it back in
    :meth:`load_state_dict`; checkpoints written with ``resumable=True``
    (``BackupAndRestore``) carry it.

    Callbacks run in the order given (the progress bar first, ``History``
    last), except where a callback says otherwise with its :attr:`order`.

    Attributes:
        order: where this callback runs among the run's callbacks: lower
            first, equal values in the order given (fastai's
            ``Callback.order``); 0 unless the callback needs the others' hooks
            around its own. ``EMA`` has -1, so that its average is in the
            network before the others' evaluation hooks and out of it after
            them. A callback whose files hold every callback's state has more,
            so that the files hold that state after the batch or epoch they
            save: a resumable ``ModelCheckpoint`` 1, ``BackupAndRestore`` 2
            (its backup then holds the ModelCheckpoint's state after its save).

    The hooks of a ``fit`` with evaluation, in order::

        set_model(model); set_params(params)
        on_train_begin
          on_epoch_begin(epoch)
            on_train_batch_begin(step) / on_before_optimizer_step(step) / on_train_batch_end(step)
            on_eval_begin / on_eval_batch_begin(step) / on_eval_batch_end(step) / on_eval_end
          on_epoch_end(epoch)           # after the evaluation: val_* keys present
        on_train_end
        on_predict_begin / on_predict_batch_begin(step) / on_predict_batch_end(step) / on_predict_end

    Example:
        .. code-block:: python

            class StopAt(callbacks.Callback):
                # Stop training once the evaluation accuracy reaches `target`.
                def __init__(self, target):
                    super().__init__()
                    self.target = target

                def on_epoch_end(self, epoch, logs=None):
                    if logs.get("val_acc", 0.0) >= self.target:
                        self.model.stop_training = True
                    if self.is_main:
                        print(f"epoch {epoch}: {logs}")
    """

    order: int = 0

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Any) -> None:
        """Give the callback the :class:`hapi.Model` it serves (``self.model``).

        Called once per ``fit``/``evaluate``/``predict``, before any hook, on
        every process. Override it (calling ``super()``) to check the model
        early, e.g. that it has an optimizer.

        Args:
            model: the running ``hapi.Model``, or a stub with the same public
                attributes in a test.
        """
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        """Give the callback the run's settings (``self.params``; a copy is kept).

        Called once per run after :meth:`set_model` and before any hook, on
        every process; an ``evaluate``/``predict`` run inside a fit gives the
        fit's params back when it ends. Override it (calling ``super()``) to reset
        what must start afresh in each run.

        Args:
            params: ``epochs``, ``steps``, ``batch_size``, ``verbose``,
                ``log_freq``, ``metrics``, ``rank``, ``world_size``, and in
                ``fit`` ``accumulate_grad_batches``, ``num_iters``,
                ``eval_steps`` and ``save_dir`` when given.
        """
        self.params = dict(params)

    @property
    def is_main(self) -> bool:
        """True on the process that prints and writes files (rank 0), from ``params["rank"]``.

        Gate a callback's own side effects with it. It reads ``self.params``,
        so a test checks rank 1's behaviour with ``set_params({"rank": 1})``
        and no process group.
        """
        return self.params.get("rank", 0) == 0

    def state_dict(self) -> dict[str, Any]:
        """What this callback must remember across a crash and resume.

        Saved in every checkpoint written with ``resumable=True`` during
        ``fit`` (``BackupAndRestore``'s backups) and given back to
        :meth:`load_state_dict` when the run resumes, so that a counter such as
        EarlyStopping's ``wait`` goes on where it was. The main process's
        state is the one written; on a resume every process gets it back.

        Returns:
            A dict whose values are tensors, numbers, strings, or lists and
            dicts of them (the file is read with
            ``torch.load(weights_only=True)``). The base class returns ``{}``.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned, when a fit resumes.

        Called when a fit resumes, after every callback's ``on_train_begin``
        (which may reset the state this restores) and before the first batch.

        Args:
            state: the dict this callback's :meth:`state_dict` returned when the
                checkpoint was saved.
        """

    def on_train_begin(self, logs: dict | None = None) -> None:
        """Called once at the start of ``fit``, on every process, before the first epoch.

        Reset per-fit state here (a fit may follow another on the same
        callback). A resumed fit restores ``model.epoch``/``model.step`` and
        the callbacks' states during this hook.

        Args:
            logs: ``{}``.
        """

    def on_train_end(self, logs: dict | None = None) -> None:
        """Called once at the end of ``fit``, on every process, also after an early stop.

        Args:
            logs: the last epoch's logs (training figures, plus ``val_*`` when
                that epoch evaluated).
        """

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        """Called at the start of each training epoch, on every process.

        Args:
            epoch: the epoch's index, from 0.
            logs: ``{}``.
        """

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Called at the end of each training epoch, after its evaluation, on every process.

        The place for per-epoch decisions (stop, save, change the learning
        rate): the figures are the same on every process.

        Args:
            epoch: the epoch's index, from 0.
            logs: the epoch's training figures (``loss``, each metric, means
                over the epoch and over every process) and, when the epoch
                evaluated, the evaluation's as ``val_<name>``.
        """

    def on_train_batch_begin(self, step: int, logs: dict | None = None) -> None:
        """Called before each training batch's step, on every process.

        Keep it cheap: it runs on every batch.

        Args:
            step: the batch's index in the epoch, from 0.
            logs: ``{}``.
        """

    def on_before_optimizer_step(self, step: int, logs: dict | None = None) -> None:
        """Called before each optimizer update, with the final gradients (Lightning's name).

        The gradients in ``model.network``'s parameters are final -- averaged
        over processes, unscaled under ``amp="fp16"`` -- and not yet clipped;
        a callback may read or change them (log their norm, mask some). With
        ``accumulate_grad_batches`` it runs once per update, at the group's
        last batch. Under FSDP each process sees the gradient shards of its
        own parameters. Runs on every process.

        Args:
            step: the index in the epoch of the batch whose update follows.
            logs: ``{}``.
        """

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        """Called after each training batch's step, on every process.

        Figures are read from the device only every ``log_freq`` steps, so
        that the other steps never wait for it.

        Args:
            step: the batch's index in the epoch, from 0.
            logs: ``batch_size`` (this process's batch); every ``log_freq``
                steps and on the epoch's last step also ``loss`` and each metric
                (running means over the epoch so far, over every process),
                ``grad_norm`` when clipping, and ``samples``, the number of
                samples they cover.
        """

    def on_eval_begin(self, logs: dict | None = None) -> None:
        """Called at the start of each evaluation (``evaluate``, or one inside ``fit``).

        Runs on every process.

        Args:
            logs: ``steps`` (this process's batches, ``None`` when unknown) and
                ``metrics`` (the names that will be logged).
        """

    def on_eval_end(self, logs: dict | None = None) -> None:
        """Called at the end of each evaluation, on every process.

        Inside ``fit`` the same figures then reach ``on_epoch_end`` as
        ``val_<name>`` (and mid-epoch ones, from ``fit(eval_steps=N)``, reach
        only this hook).

        Args:
            logs: ``loss`` and each metric over the whole evaluation data and
                every process (what ``evaluate`` returns).
        """

    def on_eval_batch_begin(self, step: int, logs: dict | None = None) -> None:
        """Called before each evaluation batch, on every process.

        Args:
            step: the batch's index in this evaluation, from 0.
            logs: ``{}``.
        """

    def on_eval_batch_end(self, step: int, logs: dict | None = None) -> None:
        """Called after each evaluation batch, on every process.

        Set ``self.model.stop_evaluating = True`` here to end the evaluation
        after this batch.

        Args:
            step: the batch's index in this evaluation, from 0.
            logs: ``batch_size``; every ``log_freq`` steps and on the last step
                also ``loss``, each metric and ``samples``. The running figures
                are this process's own (shards may differ by a batch, so no
                collective is possible there); the last batch's cover every
                process.
        """

    def on_predict_begin(self, logs: dict | None = None) -> None:
        """Called at the start of ``predict``, on every process.

        Args:
            logs: ``steps``, this process's batches (``None`` when unknown).
        """

    def on_predict_end(self, logs: dict | None = None) -> None:
        """Called at the end of ``predict``, on every process, before the outputs are gathered.

        Args:
            logs: ``{}``.
        """

    def on_predict_batch_begin(self, step: int, logs: dict | None = None) -> None:
        """Called before each prediction batch, on every process.

        Args:
            step: the batch's index, from 0.
            logs: ``{}``.
        """

    def on_predict_batch_end(self, step: int, logs: dict | None = None) -> None:
        """Called after each prediction batch, on every process.

        Set ``self.model.stop_predicting = True`` here to end the prediction
        after this batch.

        Args:
            step: the batch's index, from 0.
            logs: ``batch_size``, this process's batch.
        """


# Every hook's name, in the order Callback defines them. CallbackList precomputes, per hook,
# the callbacks that override it, so a hook nobody implements costs no call per batch.
HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))

# Batch-log keys that describe the batch, not the model: never shown or plotted as figures.
NOT_FIGURES = ("batch_size", "samples", "step")


def refuse_argument(
    owner: str, name: str, value: Any, must: str, example: str, error: type = ValueError
) -> NoReturn:
    """Raise ``error``: ``owner``'s argument ``name`` must ``must`` ("be a positive int"); the
    message names what was received and an ``example`` to pass instead."""
    raise error(
        f"{owner}: {name} must {must}; received {value!r} of type {type(value).__name__}. Pass "
        f"e.g. {example}."
    )


def as_path(owner: str, name: str, value: Any, kind: str, example: str) -> str:
    """``value``, a path (str or os.PathLike), as a str; a TypeError naming ``owner`` otherwise."""
    if not isinstance(value, (str, os.PathLike)):
        must = f"be a {kind} path (str or os.PathLike)"
        refuse_argument(owner, name, value, must, f"{owner}({example!r})", TypeError)
    return os.fspath(value)


def hook_method(hook: str, call: Callable[[Any, str, tuple, dict | None], None]) -> Callable:
    """A method for ``hook`` with :class:`Callback`'s signature and docstring that runs
    ``call(self, hook, (epoch or step,) or (), logs)``: CallbackList's and LambdaCallback's hooks."""
    names = list(inspect.signature(getattr(Callback, hook)).parameters)
    if names[1:2] == ["epoch"]:  # the same keywords as Callback's: hook(epoch=3, logs={})

        def method(self: Any, epoch: int, logs: dict | None = None) -> None:
            call(self, hook, (epoch,), logs)
    elif names[1:2] == ["step"]:

        def method(self: Any, step: int, logs: dict | None = None) -> None:
            call(self, hook, (step,), logs)
    else:

        def method(self: Any, logs: dict | None = None) -> None:
            call(self, hook, (), logs)

    return functools.wraps(getattr(Callback, hook))(method)


def stepped_to(callback: Any, every: int) -> bool:
    """Whether ``model.step`` moved since ``callback`` last looked, to a multiple of ``every``.

    The callbacks that act every N optimizer steps (ModelCheckpoint's
    ``save_steps``, BackupAndRestore's ``save_freq``, EMA's ``every_n_steps``)
    ask it at each batch end: true once per optimizer update, never between
    the batches of an accumulation group. The step looked at is the callback's
    ``_last_step``, which it sets afresh when a fit begins or resumes.
    """
    step = callback.model.step
    moved, callback._last_step = step != callback._last_step, step
    return moved and step % every == 0


class CallbackList:
    """Calls each hook on the callbacks that implement it, in list order (the loop's dispatcher).

    Every callback gets its own copy of ``logs``, so one callback mutating the
    dict cannot change what the next one sees. ``Model`` builds one per run;
    a script needs it only to drive callbacks by hand (in a test, say). It
    has every hook of :class:`Callback`, with the same arguments.

    Args:
        callbacks: the callbacks, in the order their hooks run.
    """

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks: list[Callback] = []
        self._handlers: dict[str, list] = {hook: [] for hook in HOOKS}
        for callback in callbacks:
            self.append(callback)

    def append(self, callback: Callback) -> None:
        """Add ``callback`` at the end; its hooks run after the others'.

        Args:
            callback: a :class:`Callback` instance.

        Raises:
            TypeError: ``callback`` is not a :class:`Callback`.
        """
        if not isinstance(callback, Callback):
            raise TypeError(
                f"Every callback must be a callbacks.Callback instance; received "
                f"{callback!r} of type {type(callback).__name__}. Subclass "
                "callbacks.Callback and override the hooks you need."
            )
        self.callbacks.append(callback)
        # The hooks its class overrides, less those the instance lists in ``unused_hooks`` (a
        # feature left off, e.g. ModelCheckpoint without save_steps, costs the loop no
        # per-batch call nor the figures read for it).
        unused = getattr(callback, "unused_hooks", ())
        for hook in HOOKS:
            if getattr(type(callback), hook) is not getattr(Callback, hook) and hook not in unused:
                self._handlers[hook].append(getattr(callback, hook))

    def __iter__(self):
        return iter(self.callbacks)

    def wants(self, hook: str) -> bool:
        """Whether any callback implements ``hook``, so that the loop can skip work nobody reads.

        Args:
            hook: a hook's name, e.g. ``"on_train_batch_end"``.

        Returns:
            ``True`` when at least one callback overrides it.
        """
        return bool(self._handlers[hook])

    def set_model(self, model: Any) -> None:
        for callback in self.callbacks:
            callback.set_model(model)

    def set_params(self, params: dict[str, Any]) -> None:
        for callback in self.callbacks:
            callback.set_params(params)

    def _fan_out(self, hook: str, args: tuple, logs: dict | None) -> None:
        for handler in self._handlers[hook]:
            handler(*args, logs=dict(logs) if logs else {})


for _hook in HOOKS:
    setattr(CallbackList, _hook, hook_method(_hook, CallbackList._fan_out))
