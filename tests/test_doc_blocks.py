"""Every ```python block in README.md and docs/ runs as printed.

Each block runs alone in a fresh interpreter, in an empty folder, with Fashion-MNIST read
from small IDX files this test writes (HAPI_DATA_HOME), so a block that trains on the real
data runs in seconds here. A block meant as a fragment is not marked ```python.
"""

from __future__ import annotations

import pathlib
import re
import sys

import pytest
from dist_helpers import child_env, run_bounded
from idx_files import make_mnist_dir

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks() -> list[tuple[str, str]]:
    found = []
    for document in DOCUMENTS:
        if not document.exists():
            continue
        text = document.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
            line = text[: match.start()].count("\n") + 1
            found.append((f"{document.relative_to(ROOT)}:{line}", match.group(1)))
    return found


BLOCKS = _blocks()


@pytest.fixture(scope="module")
def data_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("data_home")
    make_mnist_dir(home / "fashion-mnist", n_train=256, n_test=64)
    make_mnist_dir(home / "mnist", n_train=256, n_test=64)
    return home


def test_the_documents_have_python_blocks():
    assert len(BLOCKS) >= 2, [where for where, _ in BLOCKS]


@pytest.mark.parametrize("where, code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_python_block_runs_as_printed(where, code, tmp_path, data_home):
    script = tmp_path / "block.py"
    script.write_text(code)
    done = run_bounded(
        [sys.executable, str(script)],
        timeout=180,
        env=child_env(HAPI_DATA_HOME=str(data_home), OMP_NUM_THREADS="1"),
        cwd=tmp_path,
    )
    assert done.returncode == 0, f"{where} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
