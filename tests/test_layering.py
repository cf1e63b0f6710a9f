"""The module map's rules (STYLE.md), checked on the source."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _sources(package: str):
    return sorted((ROOT / package).glob("*.py"))


def test_callbacks_import_of_hapi_only_the_public_checkpoint_helpers():
    # The files every callback writes are the checkpoint package's (``from hapi.checkpoint
    # import files``): its public names only, never one of its modules nor the rest of hapi
    # but the leaf module of argument checks and warnings (hapi.messages).
    # ``from .. import`` neither: loaded as ``hapi.callbacks`` (issue #16), ``..`` would be hapi.
    found = [
        (p.name, target)
        for p in _sources("callbacks")
        for target in re.findall(
            r"^\s*(?:from|import)\s+(hapi\S*|\.\.\S*)", p.read_text(), re.MULTILINE
        )
    ]
    allowed = ("hapi.checkpoint", "hapi.messages")
    assert [(name, target) for name, target in found if target not in allowed] == []
    assert found, "the callbacks no longer use hapi.checkpoint's files: update this test"


def test_callbacks_import_their_own_modules_relatively():
    # ``from .base import Callback``, never ``from callbacks.base import``: the package must also
    # run under the name ``hapi.callbacks`` when a user's callbacks.py hides ``callbacks`` (issue #16).
    offenders = [
        p.name
        for p in _sources("callbacks")
        if re.search(r"^\s*(from|import)\s+callbacks\b", p.read_text(), re.MULTILINE)
    ]
    assert offenders == []


def test_hapi_reaches_its_callbacks_only_as_hapi_callbacks():
    # ``import callbacks`` may find a user's callbacks.py; hapi/_callbacks.py alone decides which is ours.
    offenders = [
        f"{p.parent.name}/{p.name}"
        for p in sorted((ROOT / "hapi").rglob("*.py"))
        if p.name != "_callbacks.py"
        and re.search(r"^\s*(from|import)\s+callbacks\b", p.read_text(), re.MULTILINE)
    ]
    assert offenders == []


def test_only_the_distributed_package_and_the_launcher_touch_torch_distributed():
    offenders = [
        p.name
        for p in _sources("hapi") + _sources("hapi/datasets") + _sources("callbacks")
        if p.name != "launch.py" and "torch.distributed" in p.read_text()
    ]
    assert offenders == []
    assert _sources("hapi/distributed"), "the distributed package moved: update this test"


def test_the_checkpoint_package_uses_dcp_but_no_process_group():
    # torch.distributed.checkpoint is a file format (and runs its own collectives); process
    # groups and ranks stay in hapi.distributed.
    offenders = [
        f"{p.name}: {found}"
        for p in _sources("hapi/checkpoint")
        for found in re.findall(
            r"^\s*(?:from|import)\s+(torch\.distributed(?!\.checkpoint\b)\S*)",
            p.read_text(),
            re.MULTILINE,
        )
    ]
    assert offenders == []
    assert _sources("hapi/checkpoint"), "the checkpoint package moved: update this test"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _hapi_imports() -> dict[str, set[str]]:
    """Each hapi module and the hapi modules it imports (at any depth of its code, lazily too).

    ``from hapi.x import y`` counts as importing ``hapi.x.y`` when that is a module, else
    ``hapi.x``. A module's own enclosing packages and the root ``hapi`` are left out: Python
    runs them first anyway, and ``hapi/__init__.py`` imports the Model and everything with it.
    """
    modules = {_module_name(p): p for p in (ROOT / "hapi").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in modules
                    else node.module
                    for alias in node.names
                ]
            else:
                continue
            targets |= {
                t for t in found if t in modules and t != "hapi" and not name.startswith(t + ".")
            }
        graph[name] = targets
    return graph


def test_hapi_modules_import_each_other_without_a_circle():
    # The checkpoint code once ran in a circle (checkpoint -> distributed -> sharded ->
    # dcp_reader -> checkpoint), held together by an import inside a function.
    graph = _hapi_imports()
    circles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for target in graph[module]:
                if target == start:
                    circles.append(" -> ".join([*path, target]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    assert circles == []


def test_the_distributed_package_never_imports_the_checkpoint_package():
    graph = _hapi_imports()
    offenders = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith("hapi.distributed")
        for target in targets
        if target.startswith("hapi.checkpoint")
    }
    assert offenders == set()


def test_files_are_written_renamed_linked_and_deleted_in_the_checkpoint_package_only():
    # One module to check for confinement (names from files joined only through
    # files.child) and for links (never written through): hapi/checkpoint/files.py.
    pattern = re.compile(
        r"\b(os\.(replace|rename|link|symlink|remove|unlink|rmdir|removedirs)|shutil\.(rmtree|move|copy\w*))\("
    )
    offenders = [
        f"{p.parent.name}/{p.name}"
        for p in _sources("hapi")
        + _sources("hapi/checkpoint")
        + _sources("hapi/distributed")
        + _sources("hapi/datasets")
        + _sources("callbacks")
        if p.relative_to(ROOT).as_posix() != "hapi/checkpoint/files.py"
        and pattern.search(p.read_text())
    ]
    assert offenders == []


def test_the_loops_and_steps_never_mention_a_rank():
    """The loops and the built-in steps run the same on every process: no rank in their code."""
    import inspect

    import hapi.model as model

    loops = [model.fit_loop, model._train_epoch, model._evaluate_in_fit, model.evaluate_loop]
    steps = [model.predict_loop, model.Model.train_step, model.Model.eval_step]
    for function in loops + steps + [model.Model.predict_step]:
        assert "rank" not in inspect.getsource(function), function.__qualname__


def test_library_code_raises_instead_of_asserting():
    offenders = [
        f"{p.parent.name}/{p.name}"
        for p in _sources("hapi")
        + _sources("hapi/checkpoint")
        + _sources("hapi/distributed")
        + _sources("hapi/datasets")
        + _sources("callbacks")
        if re.search(r"^\s*assert\b", p.read_text(), re.MULTILINE)
    ]
    assert offenders == []


def test_checkpoint_code_has_no_rank_checks():
    # Who writes and who reads is decided by two primitives of hapi.distributed
    # (on_main, broadcast_freshest) and, for shards, by DCP's coordinator, never by
    # checkpoint code testing a rank.
    offenders = [
        p.name
        for p in _sources("hapi/checkpoint")
        if re.findall(r"\b(is_main|local_rank|rank)\(\)", p.read_text())
    ]
    assert offenders == []
