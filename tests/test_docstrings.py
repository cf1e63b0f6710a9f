"""The public API documents itself: Google-style docstrings, checked against the signatures.

The API reference is generated from these docstrings (Sphinx autodoc + napoleon), so a
missing docstring is a missing page, and an ``Args:`` section that names a parameter the
function no longer has (or misses one it gained) is a wrong page. This test walks what a
user can reach -- ``hapi.__all__``, ``hapi.metrics.__all__``, ``hapi.datasets.__all__``,
``hapi.distributed.__all__``, ``callbacks.__all__``, every public method and property of
those classes (``Model``'s and ``Callback``'s hooks included) and each class's
``__init__`` -- and reports every offender in one message:

* a public callable or property without a docstring;
* an ``Args:`` section (the class docstring's, for ``__init__``) that does not name exactly
  the parameters of the signature, ``*args``/``**kwargs`` included, ``self``/``cls`` not;
* a function that returns a value (annotated, or with a ``return <value>``) and has no
  ``Returns:`` section (properties describe their value in the summary instead).

A method that overrides a documented one with the same parameters inherits its docstring
(``inspect.getdoc``), as autodoc shows it.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
import types
from typing import Any, Callable, Iterator

import callbacks
import hapi
import hapi.checkpoint
import hapi.datasets
import hapi.distributed
import hapi.launch
import hapi.metrics

_PROJECT = ("hapi", "callbacks")
_SECTION = re.compile(r"^(\s*)([A-Z][A-Za-z ]*):\s*$")
_ENTRY = re.compile(r"^(\**[A-Za-z_][A-Za-z0-9_]*)\s*(\([^)]*\))?\s*:")


def _ours(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module.split(".")[0] in _PROJECT


def _sections(doc: str) -> dict[str, list[str]]:
    """The Google-style sections of a docstring: header -> its (dedented) lines."""
    sections: dict[str, list[str]] = {}
    current: str | None = None
    indent = 0
    for line in doc.splitlines():
        match = _SECTION.match(line)
        if match and match.group(2) in (
            "Args",
            "Arguments",
            "Parameters",
            "Returns",
            "Yields",
            "Raises",
            "Example",
            "Examples",
            "Attributes",
            "Note",
            "Warning",
        ):
            current, indent = match.group(2), len(match.group(1))
            sections[current] = []
            continue
        if current is not None:
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                current = None
                continue
            sections[current].append(line)
    return sections


def _arg_names(lines: list[str]) -> list[str]:
    """The names an ``Args:`` section documents (its least-indented entries)."""
    text = textwrap.dedent("\n".join(lines))
    names = []
    for line in text.splitlines():
        if line and not line[0].isspace():
            match = _ENTRY.match(line)
            names.append(match.group(1) if match else f"<unparsed: {line.strip()[:40]}>")
    return names


def _signature_names(function: Callable) -> list[str]:
    names = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.name in ("self", "cls"):
            continue
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
        names.append(prefix.get(parameter.kind, "") + parameter.name)
    return names


def _returns_value(function: Callable) -> bool:
    annotation = inspect.signature(function).return_annotation
    if annotation is not inspect.Signature.empty:
        return annotation not in (None, "None", "NoReturn") and annotation is not type(None)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0]
    nested = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)

    def walk(node: ast.AST) -> Iterator[ast.AST]:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, nested):
                yield child
                yield from walk(child)

    return any(
        isinstance(node, (ast.Return, ast.Yield)) and node.value is not None for node in walk(body)
    )


def _check_function(where: str, function: Callable, doc: str | None, problems: list[str]) -> None:
    if not doc:
        problems.append(f"{where}: no docstring")
        return
    sections = _sections(doc)
    for other in ("Arguments", "Parameters"):
        if other in sections:
            problems.append(f"{where}: uses '{other}:'; write 'Args:' (one style)")
    expected = _signature_names(function)
    documented = _arg_names(sections.get("Args", []))
    if "Args" not in sections and expected:
        problems.append(f"{where}: no 'Args:' section for {expected}")
    elif documented != expected and sorted(documented) != sorted(expected):
        problems.append(f"{where}: 'Args:' names {documented}, the signature has {expected}")
    if _returns_value(function) and "Returns" not in sections and "Yields" not in sections:
        problems.append(f"{where}: returns a value but has no 'Returns:' section")


def _check_class(where: str, cls: type, problems: list[str], seen: set) -> None:
    doc = inspect.getdoc(cls)
    if not cls.__doc__:
        problems.append(f"{where}: no class docstring")
        return
    init = cls.__dict__.get("__init__") or next(
        (c.__dict__["__init__"] for c in cls.__mro__ if "__init__" in c.__dict__), None
    )
    if init is not None and _ours(init):
        expected = _signature_names(init)
        sections = _sections(doc)
        documented = _arg_names(sections.get("Args", []))
        if expected and "Args" not in sections:
            problems.append(f"{where}: no 'Args:' section for __init__'s {expected}")
        elif sorted(documented) != sorted(expected):
            problems.append(
                f"{where}: 'Args:' names {documented}, __init__'s signature has {expected}"
            )
    if issubclass(cls, BaseException):
        return
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        member = inspect.getattr_static(cls, name)
        owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
        if owner is None or not _ours(owner):
            continue  # inherited from torch, torchmetrics, object
        if (owner, name) in seen:
            continue  # an inherited member is reported once, where it is defined
        seen.add((owner, name))
        label = (
            f"{where}.{name}" if owner is cls else f"{owner.__module__}.{owner.__qualname__}.{name}"
        )
        if isinstance(member, property):
            if not inspect.getdoc(member):
                problems.append(f"{label}: no docstring")
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if not inspect.isfunction(member):
            continue  # data attributes
        _check_function(label, member, inspect.getdoc(getattr(cls, name)), problems)


def _public_objects() -> Iterator[tuple[str, Any]]:
    for module in (hapi, hapi.metrics, hapi.datasets, hapi.distributed, callbacks):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                continue  # walked through its own __all__
            yield f"{module.__name__}.{name}", obj
    # Errors a script catches, raised by the public API from modules with no __all__.
    yield "hapi.checkpoint.CheckpointError", hapi.checkpoint.CheckpointError
    yield "hapi.launch.SpawnedProcessError", hapi.launch.SpawnedProcessError


def find_offenders() -> list[str]:
    problems: list[str] = []
    seen: set = set()
    for where, obj in _public_objects():
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if inspect.isclass(obj):
            _check_class(where, obj, problems, seen)
        elif callable(obj):
            _check_function(where, obj, inspect.getdoc(obj), problems)
    return problems


def test_public_api_has_google_docstrings() -> None:
    problems = find_offenders()
    assert not problems, f"{len(problems)} docstring problems:\n" + "\n".join(problems)


def test_model_and_callback_are_walked() -> None:
    """The walk reaches what matters most, so that the test above cannot pass vacuously."""
    names = dict(_public_objects())
    assert names["hapi.Model"] is hapi.Model
    assert names["callbacks.Callback"] is callbacks.Callback
    for hook in ("on_train_begin", "on_eval_batch_end", "on_predict_end", "set_params"):
        assert inspect.getdoc(getattr(callbacks.Callback, hook))


def test_internals_are_not_public() -> None:
    for strategy in (hapi.DDP(), hapi.FSDP()):
        for name in ("shards_weights", "gathered", "check_own_step", "wrap_network"):
            assert not hasattr(strategy, name), f"{type(strategy).__name__}.{name} looks public"
    checkpoint = callbacks.ModelCheckpoint("unused")
    assert not hasattr(checkpoint, "is_improvement")
    assert not hasattr(checkpoint, "initial_best")
    assert "MetricSet" not in hapi.metrics.__all__
    assert "CallbackList" not in callbacks.__all__
    for internal in ("setup", "teardown", "wrap", "unwrap", "train_sampler"):
        assert internal not in hapi.distributed.__all__
    for public in (
        "rank",
        "world_size",
        "is_main",
        "local_rank",
        "DistributedSetupError",
        "init",
        "barrier",
        "main_process_first",
    ):
        assert public in hapi.distributed.__all__
