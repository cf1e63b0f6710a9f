"""The module map's rules (STYLE.md), checked on the source."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _sources(package: str):
    return sorted((ROOT / package).glob("*.py"))


def test_callbacks_never_import_hapi():
    offenders = [p.name for p in _sources("callbacks")
                 if re.search(r"^\s*(from|import)\s+hapi\b", p.read_text(), re.MULTILINE)]
    assert offenders == []


def test_only_the_distributed_package_and_the_launcher_touch_torch_distributed():
    offenders = [p.name for p in _sources("hapi") + _sources("hapi/datasets") + _sources("callbacks")
                 if p.name != "launch.py" and "torch.distributed" in p.read_text()]
    assert offenders == []
    assert _sources("hapi/distributed"), "the distributed package moved: update this test"


def test_the_loop_never_mentions_a_rank():
    assert "rank" not in (ROOT / "hapi" / "loops.py").read_text()


def test_library_code_raises_instead_of_asserting():
    offenders = [f"{p.parent.name}/{p.name}" for p in _sources("hapi") + _sources("hapi/distributed")
                 + _sources("hapi/datasets") + _sources("callbacks")
                 if re.search(r"^\s*assert\b", p.read_text(), re.MULTILINE)]
    assert offenders == []


def test_checkpoint_code_has_no_rank_checks():
    # Who writes and who reads is decided by two primitives of hapi.distributed
    # (on_main, broadcast_freshest), never by checkpoint code testing a rank.
    source = (ROOT / "hapi" / "checkpoint.py").read_text()
    assert re.findall(r"\b(is_main|local_rank|rank)\(\)", source) == []
