"""The documentation site builds with warnings as errors, and holds every page it promises.

`python -m sphinx -W --keep-going -b html docs OUT` is what a reader's build runs: a broken
link between pages, a page missing from the table of contents, a docstring that does not
render, a reference to a name that no longer exists, each fails here.
"""

from __future__ import annotations

import pathlib
import re
import sys

import pytest
from dist_helpers import child_env, run_bounded

import callbacks

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# The site's fixed layout: each page exists and is reached from a table of contents.
PAGES = [
    "index",
    "install",
    "quickstart",
    "troubleshooting",
    "changelog",
    "benchmarks",
    "design",
    "guides/training",
    "guides/data",
    "guides/callbacks",
    "guides/writing-callbacks",
    "guides/custom-step",
    "guides/checkpoints",
    "guides/dashboards",
    "guides/distributed",
    "guides/ray",
    "guides/strategies",
    "guides/fault-tolerance",
    "guides/notebooks",
    "guides/migrating",
    "reference/index",
    "reference/model",
    "reference/spawn",
    "reference/strategies",
    "reference/metrics",
    "reference/datasets",
    "reference/distributed",
    "reference/exceptions",
    "reference/environment",
]

pytest.importorskip("sphinx", reason="the docs extra is not installed: pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("html")
    done = run_bounded(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            str(DOCS),
            str(out),
        ],
        timeout=600,
        env=child_env(),
        cwd=ROOT,
    )
    assert done.returncode == 0, (
        f"the docs build failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )
    return out


def test_the_site_builds_with_warnings_as_errors(built):
    assert (built / "index.html").exists()


@pytest.mark.parametrize("page", PAGES)
def test_every_page_of_the_layout_exists(page):
    assert (DOCS / f"{page}.md").exists(), f"docs/{page}.md is missing"


def test_every_page_of_the_layout_is_built(built):
    assert [page for page in PAGES if not (built / f"{page}.html").exists()] == []


def _toctree_entries(source: pathlib.Path) -> set[str]:
    """The pages a Markdown page's ```{toctree} blocks list, as paths under docs/ (globs expanded)."""
    entries = set()
    for block in re.findall(r"^```\{toctree\}\n(.*?)^```", source.read_text(), re.M | re.S):
        for line in block.splitlines():
            line = line.strip()
            if not line or line.startswith(":"):
                continue
            base = source.parent.relative_to(DOCS) / line
            if "*" in line:
                entries |= {
                    str(p.relative_to(DOCS).with_suffix("")) for p in DOCS.glob(f"{base}.md")
                }
            else:
                entries.add(str(base))
    return entries


def test_every_page_is_in_a_table_of_contents():
    listed = set().union(*(_toctree_entries(p) for p in DOCS.rglob("*.md")))
    pages = {str(p.relative_to(DOCS).with_suffix("")) for p in DOCS.rglob("*.md")}
    assert pages - listed - {"index"} == set()
    assert set(PAGES) - {"index"} <= listed


def test_the_home_page_lists_the_layout_in_reading_order():
    order = [
        entry
        for block in re.findall(
            r"^```\{toctree\}\n(.*?)^```", (DOCS / "index.md").read_text(), re.M | re.S
        )
        for entry in (line.strip() for line in block.splitlines())
        if entry and not entry.startswith(":")
    ]
    guides = [page for page in order if page.startswith("guides/")]
    expected = ["install", "quickstart", *guides]
    expected += ["troubleshooting", "reference/index", "benchmarks", "design", "changelog"]
    assert order == expected
    assert set(guides) == {page for page in PAGES if page.startswith("guides/")}


def test_the_reference_has_a_page_per_callback():
    pages = {p.stem for p in (DOCS / "reference" / "callbacks").glob("*.md")}
    assert set(callbacks.__all__) - pages == set(), "callbacks without a reference page"
    stale = {name for name in pages if not hasattr(callbacks, name)}
    assert stale == set(), "reference pages of names callbacks no longer has"
    for name in callbacks.__all__:
        text = (DOCS / "reference" / "callbacks" / f"{name}.md").read_text()
        assert f".. autoclass:: callbacks.{name}\n" in text, name
