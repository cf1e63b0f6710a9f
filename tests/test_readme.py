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
