"""Every Python block of README.md runs on CPU."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_block_runs(i):
    exec(compile(BLOCKS[i], f"README.md block {i}", "exec"), {})


def test_ci_calls_readme_test_command():
    cmd = "pip install torch==2.13.0 && pip install -e \".[dev]\" && python -m pytest -x -q"
    assert cmd in README.read_text()
    assert cmd in (README.parent / ".ci" / "run").read_text()
