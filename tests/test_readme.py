"""Every Python block of README.md and of the documentation's guide pages runs on CPU, and the documentation
site builds with ``mkdocs build --strict``."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "guide").glob("*.md"))]
BLOCKS = [(page.relative_to(ROOT).as_posix(), i, code) for page in PAGES
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))]
OPTIONAL = ("transformers", "accelerate", "lightning", "torchtitan")  # blocks using them skip where not installed


def test_readme_has_examples():
    assert sum(page == "README.md" for page, _, _ in BLOCKS) >= 3
    assert {page for page, _, _ in BLOCKS} >= {"docs/index.md", "docs/guide/getting-started.md",
                                               "docs/guide/integrations.md", "docs/guide/distributed.md"}


@pytest.mark.parametrize("page, i, code", BLOCKS, ids=[f"{page}:{i}" for page, i, _ in BLOCKS])
def test_block_runs(page, i, code, tmp_path, monkeypatch):
    for module in OPTIONAL:
        if re.search(rf"^\s*(import|from) {module}\b", code, flags=re.M):
            pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)  # blocks write runs/ and checkpoints where they run
    exec(compile(code, f"{page} block {i}", "exec"), {"__name__": "__main__"})


def test_docs_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "reference" / "index.html").exists()


def test_ci_calls_readme_test_command():
    cmd = "pip install torch==2.13.0 && pip install -e \".[dev]\" && python -m pytest -x -q"
    assert cmd in README.read_text()
    assert cmd in (README.parent / ".ci" / "run").read_text()
