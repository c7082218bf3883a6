"""Without a GPU the Triton kernels run in Triton's interpreter on the CPU. TRITON_INTERPRET must be set before
anything imports Triton (a test module that imports it at collection, e.g. through ``pytest.importorskip``, would
otherwise fix the compiled mode for the whole session), so it is set here, before any test module is collected.
The interpreter's patches live in tests/_interpreter.py (imported here, and by worker processes that run kernels)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import _interpreter  # noqa: E402, F401
