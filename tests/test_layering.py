"""The module map's rules (STYLE.md), checked on the source."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _sources(package: str):
    return sorted((ROOT / package).glob("*.py"))


def test_callbacks_never_import_hapi():
    # ``from .. import`` too: loaded as ``hapi.callbacks`` (issue #16), ``..`` would be hapi.
    offenders = [
        p.name
        for p in _sources("callbacks")
        if re.search(r"^\s*(from|import)\s+(hapi\b|\.\.)", p.read_text(), re.MULTILINE)
    ]
    assert offenders == []


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


def test_the_loop_never_mentions_a_rank():
    assert "rank" not in (ROOT / "hapi" / "loops.py").read_text()


def test_library_code_raises_instead_of_asserting():
    offenders = [
        f"{p.parent.name}/{p.name}"
        for p in _sources("hapi")
        + _sources("hapi/distributed")
        + _sources("hapi/datasets")
        + _sources("callbacks")
        if re.search(r"^\s*assert\b", p.read_text(), re.MULTILINE)
    ]
    assert offenders == []


def test_checkpoint_code_has_no_rank_checks():
    # Who writes and who reads is decided by two primitives of hapi.distributed
    # (on_main, broadcast_freshest), never by checkpoint code testing a rank.
    source = (ROOT / "hapi" / "checkpoint.py").read_text()
    assert re.findall(r"\b(is_main|local_rank|rank)\(\)", source) == []
