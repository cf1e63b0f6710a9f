"""LambdaCallback: a callback made of plain functions, for the one-off hook (Keras 3).

A few lines that print, log or check something at one point of the run should
not need a class. The loop calls a hook only on the callbacks that implement it
(``callbacks.base``), so a LambdaCallback lists the hooks it was not given in
``unused_hooks``: one given only ``on_epoch_end`` costs no call per batch.
"""

from __future__ import annotations

from typing import Any, Callable

from .base import HOOKS, Callback, hook_method


class LambdaCallback(Callback):
    """Calls the functions given for each hook, with the hook's arguments, positionally.

    Args:
        on_epoch_begin: ``f(epoch, logs)`` at the start of every epoch.
        on_epoch_end: ``f(epoch, logs)`` at the end of every epoch.
        on_train_begin: ``f(logs)`` when training begins.
        on_train_end: ``f(logs)`` when training ends.
        on_train_batch_begin: ``f(step, logs)`` before every training batch.
        on_train_batch_end: ``f(step, logs)`` after every training batch.
        **kwargs: any other hook of :class:`callbacks.Callback` by name --
            ``on_eval_begin(logs)``, ``on_eval_batch_end(step, logs)``,
            ``on_predict_end(logs)``, ``on_before_optimizer_step(step, logs)``,
            ... Keras' ``on_test_*`` names are accepted for the ``on_eval_*``
            hooks, and ``on_batch_begin``/``on_batch_end`` for the training
            batch hooks. Any other keyword not starting with ``on_`` becomes an
            attribute of the callback, as in Keras.

    Raises:
        TypeError: a hook given twice (``on_test_end`` and ``on_eval_end``), a
            value that is not callable, or an ``on_*`` name that is no hook
            (a misspelt hook would otherwise never run).

    Example (``LambdaCallback`` imported from ``callbacks``)::

        seen = []
        cb = LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(logs["loss"]))
        model.fit(data, epochs=3, callbacks=[cb])  # seen: the loss of each epoch
    """

    def __init__(
        self,
        on_epoch_begin: Callable[..., Any] | None = None,
        on_epoch_end: Callable[..., Any] | None = None,
        on_train_begin: Callable[..., Any] | None = None,
        on_train_end: Callable[..., Any] | None = None,
        on_train_batch_begin: Callable[..., Any] | None = None,
        on_train_batch_end: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        named = {name: fn for name, fn in locals().items() if name.startswith("on_")}
        self._functions: dict[str, Callable[..., Any]] = {}
        for name, fn in {**named, **kwargs}.items():
            if not name.startswith("on_"):
                setattr(self, name, fn)  # Keras: extra keywords become attributes
                continue
            # Keras' names: on_test_* for what torch-hapi calls evaluation, on_batch_* for training.
            hook = name.replace("on_test_", "on_eval_").replace("on_batch_", "on_train_batch_")
            if hook not in HOOKS:
                raise TypeError(
                    f"LambdaCallback received {name}=, which is no callback hook. Pass one of "
                    f"{', '.join(HOOKS)} (Keras' on_test_* names mean on_eval_*)."
                )
            if hook in self._functions:
                raise TypeError(
                    f"LambdaCallback received two functions for {hook} ({name}= is another name "
                    "for it). Pass one."
                )
            if fn is None:
                continue
            if not callable(fn):
                raise TypeError(
                    f"LambdaCallback: {hook} must be a function; received {fn!r} of type "
                    f"{type(fn).__name__}. Pass e.g. {hook}=lambda *args: print(args)."
                )
            self._functions[hook] = fn
        # The loop skips the hooks listed here (callbacks.base): no call for a hook not given.
        self.unused_hooks = tuple(hook for hook in HOOKS if hook not in self._functions)


def _call(self: LambdaCallback, hook: str, args: tuple, logs: dict | None) -> None:
    self._functions[hook](*args, logs)


for _hook in HOOKS:
    setattr(LambdaCallback, _hook, hook_method(_hook, _call))
