"""Every ```python block in README.md and docs/ runs as printed.

A page is run like a notebook: its blocks, in order, in one fresh interpreter, sharing one
namespace, so a block may use what an earlier block of the same page defined. The interpreter
is forked from the tests' warm one (warm_launcher: torch imported once, hapi not; a cold
``python`` with HAPI_TESTS_COLD=1), which saves each page seconds of imports. Each page runs
in an empty folder, with Fashion-MNIST and MNIST read from small IDX files this test writes
(HAPI_DATA_HOME: 256 training and 64 test images), so a page that trains on the real data runs
in seconds here, and with one thread (OMP_NUM_THREADS=1). A failure names the page and the
line of the block that failed. A block meant as a fragment is not marked ```python; code for
several processes lives in examples/ (shown with literalinclude), which tests/examples runs.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from dist_helpers import child_env, run_python
from idx_files import make_mnist_dir

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)

# Runs the blocks given as JSON [[line, code], ...] in one namespace, as one page; on an
# error names the page and the line of the failing block.
RUNNER = """
import json as _json, sys as _sys, traceback as _traceback

_blocks = _json.load(open(_sys.argv[1]))
_page = _sys.argv[2]
# The blocks run in this script's own namespace, the real __main__ (pickle and dataclasses need
# one), and their tracebacks give the page's line numbers: code starts after its fence's line.
for _line, _code in _blocks:
    try:
        exec(compile("\\n" * _line + _code, f"<{_page}>", "exec"), globals())
    except BaseException:
        _traceback.print_exc()
        print(f"FAILED: {_page}, the block at line {_line}", file=_sys.stderr)
        _sys.exit(1)
"""


def _pages() -> list[tuple[str, list[tuple[int, str]]]]:
    """(page, [(line of the opening fence, code), ...]) for each page with python blocks."""
    found = []
    for document in DOCUMENTS:
        if not document.exists():
            continue
        text = document.read_text()
        blocks = [
            (text[: match.start()].count("\n") + 1, match.group(1))
            for match in BLOCK.finditer(text)
        ]
        if blocks:
            found.append((str(document.relative_to(ROOT)), blocks))
    return found


PAGES = _pages()


@pytest.fixture(scope="module")
def data_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("data_home")
    make_mnist_dir(home / "fashion-mnist", n_train=256, n_test=64)
    make_mnist_dir(home / "mnist", n_train=256, n_test=64)
    return home


def test_the_documents_have_python_blocks():
    blocks = sum(len(blocks) for _, blocks in PAGES)
    assert len(PAGES) >= 2 and blocks >= 2, [page for page, _ in PAGES]


@pytest.mark.parametrize("page, blocks", PAGES, ids=[page for page, _ in PAGES])
def test_page_runs_as_printed(page, blocks, tmp_path, data_home):
    work = tmp_path / "work"  # the page's own empty folder
    work.mkdir()
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "run_page.py").write_text(RUNNER)
    done = run_python(
        [tmp_path / "run_page.py", tmp_path / "blocks.json", page],
        timeout=300,
        env=child_env(HAPI_DATA_HOME=str(data_home), OMP_NUM_THREADS="1"),
        cwd=work,
    )
    assert done.returncode == 0, (
        f"{page} ({len(blocks)} blocks) failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
