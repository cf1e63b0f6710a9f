"""Find torch-hapi's own ``callbacks`` package, whatever lies beside the user's script.

``callbacks`` is a top-level package (``from callbacks import ModelCheckpoint``), and Python
searches the script's directory first, so a project's own ``callbacks.py`` (or ``callbacks/``
package) there hides it: a plain ``from callbacks import History`` inside hapi would then read the
user's file and fail. So hapi never imports ``callbacks`` by that name; it imports
``hapi.callbacks``, which this module provides:

* nothing in the way: ``hapi.callbacks`` *is* the ``callbacks`` package, and each
  ``hapi.callbacks.<module>`` is ``callbacks.<module>``, so classes are the same objects by
  either name (``isinstance`` and pickles agree);
* a module of the user's in the way: torch-hapi's package is loaded from where it is installed
  (next to ``hapi/``) under the name ``hapi.callbacks``, the user's ``callbacks`` stays theirs,
  and one line on stderr names the file (in a job's first process only, not in each worker).

This works because the callbacks package imports its own modules relatively (``from .base import
Callback``), so it runs under either name; ``tests/test_layering.py`` keeps it that way.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import os
import pkgutil
import sys
import types

NAME = "hapi.callbacks"
HOME = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "callbacks")
INIT = os.path.join(HOME, "__init__.py")


def _origin_of_callbacks() -> str | None:
    """Where ``import callbacks`` would load from (or has loaded from), without running it."""
    try:  # a module in sys.modules (perhaps half-initialised: a user's callbacks.py importing hapi)
        spec = importlib.util.find_spec("callbacks")  # gives its __spec__
    except ValueError:  # ... that has no __spec__
        return getattr(sys.modules["callbacks"], "__file__", None) or repr(sys.modules["callbacks"])
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or []) or "callbacks"


def _is_ours(origin: str | None) -> bool:
    return origin is not None and os.path.realpath(origin) == os.path.realpath(INIT)


def _first_process() -> bool:
    """False in the processes a job starts besides its first: torchrun's ranks > 0 (``RANK``) and
    the children of ``hapi.spawn`` or of spawned DataLoader workers, which import hapi again."""
    process = multiprocessing.current_process()  # _inheriting: set while a spawned child imports
    child = multiprocessing.parent_process() is not None or getattr(process, "_inheriting", False)
    return os.environ.get("RANK", "0") == "0" and not child


def _resolve() -> types.ModuleType:
    origin = _origin_of_callbacks()
    ours = _is_ours(origin)
    if ours:
        package = sys.modules[NAME] = importlib.import_module("callbacks")
    else:  # load torch-hapi's package from its installed directory as hapi.callbacks
        if not os.path.isfile(INIT):
            raise ImportError(
                f"torch-hapi's callbacks package is missing: expected {INIT} beside hapi/. "
                "Reinstall torch-hapi (pip install --force-reinstall torch-hapi)."
            )
        spec = importlib.util.spec_from_file_location(NAME, INIT, submodule_search_locations=[HOME])
        package = sys.modules[NAME] = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(package)
        except BaseException:
            del sys.modules[NAME]
            raise
    # hapi.callbacks.<module> is the very module callbacks.<module> (or hapi.callbacks'), for each.
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        sys.modules[f"{NAME}.{info.name}"] = module
    if origin is not None and not ours and _first_process():
        # Shown as the user would type it: ./callbacks.py for one in the working directory.
        here = os.path.join(os.getcwd(), "")
        shown = os.path.join(".", origin[len(here) :]) if origin.startswith(here) else origin
        print(
            f"torch-hapi: {shown} shadows torch-hapi's callbacks package; torch-hapi uses its own "
            "(importable as hapi.callbacks), and `import callbacks` gives yours.",
            file=sys.stderr,
        )
    return package


callbacks = _resolve()
