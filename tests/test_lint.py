"""The code keeps the project's style: ruff's checks and formatter (configured in pyproject.toml)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    script = pathlib.Path(sys.executable).with_name("ruff")  # pip's console script beside python
    command = [str(script)] if script.exists() else [shutil.which("ruff") or "ruff"]
    return subprocess.run([*command, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check_passes():
    result = _ruff("check", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_code_is_formatted_with_ruff():
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, (
        "Run `ruff format .`:\n" + result.stdout[-4000:] + result.stderr[-2000:]
    )
