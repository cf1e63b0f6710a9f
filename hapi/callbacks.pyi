# For type checkers only: ``hapi.callbacks`` is torch-hapi's ``callbacks`` package, made at run
# time by hapi/_callbacks.py (which a type checker cannot follow). Without this file mypy
# reports "Cannot find implementation or library stub for module named hapi.callbacks" for
# ``from hapi.callbacks import ModelCheckpoint``, and reads Model.fit's callbacks as Any.
from callbacks import *  # noqa: F403
from callbacks import __all__ as __all__
