"""The wheel a user installs holds every package of the source tree.

A hand-kept package list once left out ``hapi.checkpoint``: an editable install worked,
``pip install .`` gave an ``import hapi`` that failed at the first save.
"""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _build_wheel(tmp_path) -> zipfile.ZipFile:
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("*.whl")
    return zipfile.ZipFile(wheel)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_holds_every_package(wheel):
    in_wheel = {
        name.rsplit("/", 1)[0] for name in wheel.namelist() if name.endswith("/__init__.py")
    }
    in_source = {
        str(init.parent.relative_to(ROOT))
        for top in ("hapi", "callbacks")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert in_source - in_wheel == set(), f"packages missing from the wheel: {in_source - in_wheel}"


def test_wheel_is_typed_licensed_and_versioned_from_one_place(wheel):
    """py.typed in both packages (PEP 561), the license text, and the version hapi reports."""
    names = wheel.namelist()
    assert {"hapi/py.typed", "callbacks/py.typed"} <= set(names)
    assert any(name.endswith("licenses/LICENSE") or name.endswith("/LICENSE") for name in names)
    source = (ROOT / "hapi" / "__init__.py").read_text()
    (version,) = re.findall(r'^__version__ = "([^"]+)"$', source, re.MULTILINE)
    metadata = next(name for name in names if name.endswith(".dist-info/METADATA"))
    assert f"\nVersion: {version}\n" in wheel.read(metadata).decode()
    assert (
        "version ="
        not in (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.dynamic]")[0]
    )
