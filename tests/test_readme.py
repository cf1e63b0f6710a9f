"""The README's two set-up commands exist, and CI runs exactly the test one."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set up and run", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_readme_has_a_demo_and_a_test_command_installing_pinned_torch_first():
    demo, test = _commands()
    for command in (demo, test):
        assert command.index("pip install torch==2.13.0") < command.index("pip install -e")
    assert demo.endswith("python examples/hapitrain.py")
    assert test.endswith("python -m pytest")


def test_ci_runs_the_readme_test_command():
    _, test = _commands()
    assert test in (ROOT / ".ci" / "run").read_text().splitlines()


def _first(fence: str, page: str) -> str:
    """The first ``fence`` block of ``page`` (README.md: of its Quickstart section)."""
    text = (ROOT / page).read_text()
    if page == "README.md":
        text = text.split("## Quickstart", 1)[1]
    return re.search(rf"```{fence}\n(.+?)\n```", text, re.DOTALL).group(1)


def test_readme_quickstart_and_index_show_one_first_program_with_one_output():
    """A newcomer meets one program and its real output, whichever page they open first."""
    pages = ("README.md", "docs/quickstart.md", "docs/index.md")
    programs = {page: _first("python", page) for page in pages}
    outputs = {page: _first("text", page) for page in pages}
    assert len(set(programs.values())) == 1, programs
    assert len(set(outputs.values())) == 1, outputs
    assert "Epoch 2/2" in outputs["README.md"] and "acc_top1" in outputs["README.md"]
