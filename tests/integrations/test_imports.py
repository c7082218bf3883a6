"""The integrations are optional: ``import matrixopt`` imports no framework and no docs tool."""

import subprocess
import sys

OPTIONAL = ("transformers", "accelerate", "lightning", "pytorch_lightning", "mkdocs", "torchtitan",
            "matrixopt.integrations")


def test_core_import_leaves_the_frameworks_alone():
    code = ("import sys, matrixopt, matrixopt.distributed; "
            f"print(sorted(m for m in {OPTIONAL!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
