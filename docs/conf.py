"""Sphinx configuration for the torch-hapi documentation site.

Build it (warnings are errors, as in the test suite):

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Pages are Markdown (myst-parser); the API reference is generated from the docstrings
(autodoc, Google style through napoleon). Nothing is fetched from the network while building.
"""

from __future__ import annotations

import os
import sys

# The package documents itself from this checkout, even where another copy is installed.
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

import hapi  # noqa: E402  (after the path above)

project = "torch-hapi"
author = "torch-hapi contributors"
copyright = "torch-hapi contributors, Apache-2.0"
version = release = hapi.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Markdown: `[resume](checkpoints.md#resume)` links to headings down to level 3;
# ::: fences for directives.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# The reference: Google-style docstrings only; type hints shown in the signatures.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_default_options: dict[str, object] = {}
# Building the reference imports the package and nothing heavier than it.
autodoc_mock_imports: list[str] = []

html_theme = "furo"
html_title = f"torch-hapi {release}"
html_show_sourcelink = False
pygments_style = "sphinx"
