"""The wheel a user installs holds every package of the source tree.

A hand-kept package list once left out ``hapi.checkpoint``: an editable install worked,
``pip install .`` gave an ``import hapi`` that failed at the first save.
"""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_every_package(tmp_path):
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
    in_wheel = {
        name.rsplit("/", 1)[0]
        for name in zipfile.ZipFile(wheel).namelist()
        if name.endswith("/__init__.py")
    }
    in_source = {
        str(init.parent.relative_to(ROOT))
        for top in ("hapi", "callbacks")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert in_source - in_wheel == set(), f"packages missing from the wheel: {in_source - in_wheel}"
